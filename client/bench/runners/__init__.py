"""Peer runner scripts, executed as files by the peer's own Python (see protocol.py); a package
only so that they ship with `client.bench`."""
