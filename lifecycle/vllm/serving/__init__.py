"""Whether the engine may run the draft in a step: the drafting gate, on both model runners."""
