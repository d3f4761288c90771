"""Tensor parallelism: the ranks' process group and collectives (parallel_state), and the
executors that run one step's plan on every rank (uniprocess, multiprocessing, Ray)."""
