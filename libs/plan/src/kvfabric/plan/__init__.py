"""kvplan: plans memory, metadata and network for a kvfabric cluster before it is deployed."""
