"""ROCm container images with the stack: `make rocm-image` / `make rocm-source-image`
(rocm_image) and the smoke check the overlay recipe runs inside the image by path
(rocm_smoke, standard library only before vLLM)."""
