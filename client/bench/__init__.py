"""`folio bench`: Folio side by side with vLLM's CPU build and HF transformers, in one run.

    cli.py          the command: peers, interleaved repetitions, result files
    context.py      `folio bench context`: the latency workload at several context lengths
    peers.py        how each peer starts (Folio, vLLM, HF) and the checkpoint they load
    workload.py     seeded prompts (token ids), output lengths, arrival times
    folio_peer.py   a real `folio serve`, driven through the gRPC stream
    runner_peer.py  vLLM / HF as long-lived subprocesses (runners/, their own Python)
    metrics.py      per-request timings -> metrics; repetitions -> median and range
    models.py       the checkpoint every peer loads (Folio's resolution, or random weights)
    report.py       JSON, Markdown table, PNG plot, machine facts
    load.py         --competing-load
"""
