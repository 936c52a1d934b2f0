"""ferry's benchmarks and the `ferry bench` client."""
