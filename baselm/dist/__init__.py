"""Running one model over more than one process: prefill/decode disaggregation and its wire."""
