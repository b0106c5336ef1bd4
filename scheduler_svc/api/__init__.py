"""The public front door: the gRPC servicers (folio.v1.Generator, the vLLM worker contract and
its field map), request validation and prompt encoding, structured-output checks, API keys,
reflection and the metrics HTTP endpoint. It turns requests into `SubmitParams` for the engine
and its errors into gRPC statuses; it may import `engine`, `sched` (types), `text`, `protos`."""
