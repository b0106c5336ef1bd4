"""Every schema that crosses a process: the public gRPC API (`folio/v1/generator.proto` and its
committed stubs), the step-plan protocol between scheduler and executor (`plan.py`, with the
sampling parameters in `sampling_spec.py` and the strict field readers in `wire.py`), the ZeroMQ
channel ends and codec (`channel.py`) and keys (`channel_keys.py`), what each structured
output kind means (`structured_grammar.py`), and the layout and checks of the prefix cache's
host tier in shared memory (`kv_tier_file.py`). Imports no other first-party package and never
torch: both services and the client load it."""
