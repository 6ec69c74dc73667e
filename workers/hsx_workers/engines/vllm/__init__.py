"""Everything hsx knows of vLLM, in one package.

- engine.py: `VllmEngine`, the capture engine (vLLM's `extract_hidden_states` method);
- settings.py: `VllmSettings`, what the engine takes (built from the job's `vllm:`);
- rules.py: what vLLM asks of a job (its length, the engine arguments a job may pass,
  the settings this vLLM captures wrong under): the service asks here;
- connector.py: hsx's KV connector, loaded by vLLM by its module path;
- hostcopy.py: the connector's copy of a step's states to the host;
- spool.py: the files between vLLM's engine process and the actor;
- hooks.py: the fallback capture for models without EAGLE-3 outputs (a vLLM worker
  extension);
- compat.py: what differs between the supported vLLM releases;
- compile_cache.py: a broken compile cache named in an engine's start error;
- classes.py: the vLLM class that serves an architecture, and whether it has EAGLE-3
  aux outputs (the model preflight asks);
- missing_torchvision.py: importing vLLM's multimodal modules where torchvision is
  missing.

Importing this package imports nothing: engine.py, connector.py, hostcopy.py and
hooks.py import torch or vLLM; the others import vLLM inside functions, so the service
may import them (settings.py and rules.py, at its import).
"""
