"""One step on the device: the persistent input batch, the step's inputs built from a plan
(one host-to-device copy), the plan's checks, forward metadata and attention backends, the
ModelRunner that runs the model and samples, CUDA graphs and kernel warm-up."""
