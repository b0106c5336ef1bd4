"""The `folio` protobuf package (the public API's namespace)."""
