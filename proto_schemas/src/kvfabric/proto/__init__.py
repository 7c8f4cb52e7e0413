"""kvfabric wire schemas: every NATS subject and every message, defined once.

- `subjects`: functions that build every subject (`kvf.v1.<service>.<verb>`).
- `codec`: msgpack encode, one typed decoder per message family, decode errors → `BadRequest`.
- `common`: the error body and header names shared by every service.
- one module per message family (`echo`, ...): a tagged union of `msgspec.Struct`s.
- `registry`: the list of families, from which `make schemas` generates JSON Schema.

Evolution rules (msgspec schema evolution): new fields get defaults; never change a field's type
or a tag; never reuse a removed field's name; a breaking change is a new subject version
(`kvf.v2...`). Golden encoded messages in `proto_schemas/golden/` pin the wire forever.
"""
