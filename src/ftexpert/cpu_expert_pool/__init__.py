"""CPU expert processes: compute the experts the GPU does not fetch, reading the shared store in place."""
