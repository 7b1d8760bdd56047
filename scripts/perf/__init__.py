"""Performance of the stack: `make bench` (the everyday commands against their goals),
`make gpubench` (the stack's GPU kernels timed against the release) and amd_resources/
(the kernels compiled for MI300/MI355 on CPU, held to each GPU's LDS and scratch)."""
