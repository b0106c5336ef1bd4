"""The engine loop and what it owns: executor connections (handshake, channel reader, the
`folio serve` supervisor), admission of requests into the Scheduler, the registry of every
accepted request across executors, output processing, stats and metrics, and the stall
watchdog. It drives `sched` and `text`; of `api` it uses only the checks a request
meets against the connected executor (`api/inputs.py`)."""
