"""SGLang servers as rollout engines (the GPU path), over HTTP; sglang itself is imported lazily.

engine.py    SGLangEngine, the client of one server
protocol.py  what goes over the wire: /generate bodies, weight payloads, versions
server.py    the launch command, address, API key and log file of one server
colocated.py the servers on the actor's GPUs of every node, memory hand-over, CUDA IPC sync
"""
