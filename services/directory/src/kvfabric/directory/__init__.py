"""The directory service: a thin shell over `kvfabric.core.directory.DirectoryCore`."""
