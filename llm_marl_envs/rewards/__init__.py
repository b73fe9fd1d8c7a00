"""Pure reward functions: text in, named reward parts out. No I/O except the code sandbox."""
