"""Integrations with agent frameworks: their tool calls as operations of a session.

Each framework has a module of its own (`saga.integrations.pydantic_ai`), installed with
an extra (`pip install 'saga-orchestrator[pydantic-ai]'`); what they share, and what
knows no framework, is `saga.integrations._tool_calls`. The core package never imports
anything from here.
"""
