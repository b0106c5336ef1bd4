"""One step on the device: the persistent input batch, the step's inputs built from a plan
(one host-to-device copy) and its outputs read back (one device-to-host transfer of named
segments), the plan's validation, forward metadata and attention backends, the ModelRunner
that holds these parts and runs the model, CUDA graphs and kernel warm-up."""
