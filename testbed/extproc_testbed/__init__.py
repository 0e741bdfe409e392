"""What runs the product on one machine without GPUs, apart from the product itself: the
simulated vLLM server, the local stack of real processes (demo and tests), and the drills and
benchmarks built on them. Nothing in production imports this package."""
