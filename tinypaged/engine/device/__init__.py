"""The device side: the model runner (inputs staged into persistent buffers, CUDA graphs, the forward), the
executor that drives it in this process or over tensor-parallel worker processes, and their distributed
plumbing. Takes a SchedulerOutput, returns logits; imports no other engine layer."""
