"""`disagg up`: a DisaggregatedInference spec run as local processes (router + prefill + decode workers),
supervised and autoscaled like the operator does on Kubernetes."""
