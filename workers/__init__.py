"""Code that runs inside each vLLM worker rank (loaded through ``worker_extension_cls``)."""
