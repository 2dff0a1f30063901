"""autosessd: keeps long LLM conversations warm across switches and restarts."""

__version__ = "0.1.0"
