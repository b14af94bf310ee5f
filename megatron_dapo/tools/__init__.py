"""Tool calls inside a response (issue 40): the episode driver, call formats, the sandbox, the tools.

episode.py drives every episode; registry.py builds a run's tool set from its `tools` section;
custom.py runs users' `package.module:function` tools in worker processes.
"""
