"""How a request picks its tokens: `SamplingParams` (params.py), the batched `Sampler` (sampler.py),
stop strings (stop.py) and the speculative acceptance rule (acceptance.py) the sampler and speculator share."""
