"""Generated stubs of `folio.v1` (`python -m protos.generate`); never edited by hand."""
