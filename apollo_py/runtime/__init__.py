"""Executables: reference runner, memory plan, thread pool, the CPU executable, BLAS binding."""
