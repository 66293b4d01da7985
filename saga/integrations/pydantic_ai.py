"""pydantic-ai: every tool call of an agent run as an operation of a session.

    pip install 'saga-orchestrator[pydantic-ai]'

`DurableTools` is a pydantic-ai capability. An agent built with it makes each tool call
inside `async with aorch.session(run_id):` (an `AsyncOrchestrator`'s session) a durable
call of that session, as `saga.integrations._tool_calls` describes: keyed by business
fields of the arguments (a `ToolPolicy` in the tool's metadata, `tool_policy(...)`), run
once per key, replayed with its stored result when the model asks again with a new
`tool_call_id` (in this run, a retried one, or one in another process after a crash),
deferred for an approval bound to its request hash when its confirm rule holds, and
compensated in reverse when the session fails for good.

    durable = DurableTools(approval_key=APPROVERS_KEY)
    agent = Agent(model, name="support", capabilities=[durable],
                  output_type=[str, DeferredToolRequests])

    @agent.tool_plain(metadata=tool_policy(key="{order_id}", idempotent=True,
                                           compensate=undo_refund,
                                           confirm=lambda a: a["amount_cents"] > 10_000))
    def refund(order_id: str, amount_cents: int, note: str = "") -> dict: ...

    async with aorch.session(ticket_id):
        result = await agent.run(prompt)     # AgentRunDeferred while approvals are pending

The pydantic-ai hooks used (pydantic-ai-slim 2.16 or later, chosen from its source):

- A capability (`AbstractCapability`), not a `WrapperToolset`: its hooks see every
  function tool of the run, whichever toolset holds it, and its `wrap_tool_execute`
  wraps the whole execution lifecycle of one call after its arguments were validated
  (the tool, and the `before_tool_execute` / `after_tool_execute` hooks of every
  capability). The call runs inside the session's durable call, so a replay skips all of
  it and answers with the stored result. The capability sits in the `innermost` tier
  (`get_ordering`), the place pydantic-ai gives durable execution: the wrap hooks of
  other capabilities (tracing, guards) stay outside and see replays too.
- Deferring for approval: `wrap_tool_execute` raises `ApprovalRequired(metadata=...)`
  before calling its handler, which pydantic-ai documents as deferring the call before
  the tool runs; the run ends with `DeferredToolRequests` (the metadata holds the
  `ApprovalRequest`). The approved run passes `DeferredToolResults` with the signed
  token in the call's metadata (`approval_results`); pydantic-ai hands it to the hook
  as `RunContext.tool_call_metadata`. Its own `tool_call_approved` flag is a boolean per
  `tool_call_id` and releases nothing here: a missing, forged, expired or other-hash
  token defers the call again, the reason in its metadata. A tool declared with
  `requires_approval=True` (kind `'unapproved'`, which pydantic-ai would release on that
  boolean) is turned into a function tool whose confirm rule always holds, in
  `prepare_tools`.
- `prepare_tools` also marks every function tool `sequential`: a session runs its calls
  one at a time, and parallel siblings cancelled when one fails would leave calls cut
  off mid-effect.
- `after_run`: a run whose output is `DeferredToolRequests` raises `AgentRunDeferred`
  instead of returning, so the session block is left by an exception that keeps the
  session open (leaving it normally would complete it, and the approved call could not
  run in it afterwards).
- `on_run_error`: run errors listed in `fail_on` (a usage limit, a model that gives up)
  are raised as `PermanentError`, the session's failure path: its succeeded calls are
  compensated in reverse. A `PermanentError` from a tool propagates as it is.
- `for_agent`: binds the capability to its agent when the agent is built, so the
  durable step is registered (under `name`, else the agent's name) before any session is
  entered, and a process that did not make a call finds its tool's policy from the
  agent's tools.
- Tool metadata (`@agent.tool(metadata=...)`, `Tool(metadata=...)`) carries each tool's
  `ToolPolicy` into `ToolDefinition.metadata`, which every hook receives.
- `ModelRetry` / `ToolFailed` raised by a tool (pydantic-ai wraps them as
  `ToolRetryError` / `ToolFailedError` before the hook sees them) did nothing: the call
  is stored with that answer and replays as `ModelRetry` / `ToolFailed`. Checks that
  should let the model correct its arguments belong in the tool's `args_validator`,
  which pydantic-ai runs before execution: a `ModelRetry` raised in the tool's body
  uses the call's key, and a corrected call under the same key is a conflict.

Where pydantic-ai falls short: its approvals are per `tool_call_id` and carry no
binding to the arguments (hence the token in the metadata); a resumed run needs the
message history the caller kept (`AgentRunDeferred.messages`); streamed runs
(`run_stream`, `iter`) get the same tool calls, but `AgentRunDeferred` is raised only
where pydantic-ai calls `after_run`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic_ai import DeferredToolRequests, DeferredToolResults, FunctionToolset, RunContext
from pydantic_ai.capabilities import (
    AbstractCapability,
    CapabilityOrdering,
    ValidatedToolArgs,
    WrapToolExecuteHandler,
)
from pydantic_ai.exceptions import (
    ApprovalRequired,
    CallDeferred,
    ModelRetry,
    SkipToolExecution,
    ToolFailed,
    ToolFailedError,
    ToolRetryError,
    UnexpectedModelBehavior,
)
from pydantic_ai.messages import ModelMessage, ToolCallPart
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import AbstractToolset

from saga.errors import SagaDefinitionError, SagaError
from saga.integrations._tool_calls import (
    ApprovalKey,
    ApprovalNeeded,
    ApprovalRequest,
    ConfirmRule,
    KeyFunction,
    NoEffect,
    OutsideSession,
    ToolCalls,
    ToolPolicy,
    check_fail_on,
    check_policy,
    run_failure,
    sign_approval,
)
from saga.retry import RetryPolicy

if TYPE_CHECKING:
    from pydantic_ai.agent.abstract import AbstractAgent
    from pydantic_ai.run import AgentRunResult

__all__ = [
    "APPROVAL_TOKEN",
    "METADATA_KEY",
    "AgentRunDeferred",
    "ApprovalRequest",
    "DurableTools",
    "OutsideSession",
    "ToolPolicy",
    "approval_requests",
    "approval_results",
    "sign_approval",
    "tool_policy",
]

# The key of a tool's metadata that holds its ToolPolicy.
METADATA_KEY = "saga"
# The key of a deferred call's metadata (`DeferredToolResults.metadata`) holding the token.
APPROVAL_TOKEN = "saga_approval"
# Set by `prepare_tools` on a tool declared `requires_approval=True`.
_APPROVAL_REQUIRED = "saga.requires_approval"
# The policy of a tool that has none: keyed by all its arguments, never retried blind.
_DEFAULT_POLICY = ToolPolicy()
# Answers to the model, as stored: kind -> the exception a replay raises.
_RETRY, _FAILED = "retry", "failed"


def tool_policy(
    *,
    key: str | KeyFunction | None = None,
    volatile: Sequence[str] = (),
    idempotent: bool = False,
    reconcile: Callable[..., Any] | None = None,
    compensate: Callable[..., Any] | None = None,
    confirm: ConfirmRule = False,
    retry: RetryPolicy | None = None,
    compensation_retry: RetryPolicy | None = None,
    compensation_idempotent: bool = False,
    timeout_seconds: float | None = None,
) -> dict[str, Any]:
    """A tool's metadata holding its `ToolPolicy` (see it for the arguments):
    `@agent.tool_plain(metadata=tool_policy(key="{order_id}", idempotent=True))`."""
    return {
        METADATA_KEY: ToolPolicy(
            key=key,
            volatile=tuple(volatile),
            idempotent=idempotent,
            reconcile=reconcile,
            compensate=compensate,
            confirm=confirm,
            retry=retry,
            compensation_retry=compensation_retry,
            compensation_idempotent=compensation_idempotent,
            timeout_seconds=timeout_seconds,
        )
    }


class AgentRunDeferred(SagaError):
    """The agent run ended with deferred tool calls (approvals, external calls): the
    session stays open for the run that resolves them.

    Attributes:
        result: The run's result; its output is `requests`.
        requests: The `DeferredToolRequests`.
    """

    def __init__(self, result: AgentRunResult[Any]) -> None:
        self.result = result
        requests = result.output
        assert isinstance(requests, DeferredToolRequests)
        self.requests: DeferredToolRequests = requests
        waiting = len(requests.approvals) + len(requests.calls)
        super().__init__(
            f"the agent run ended with {waiting} deferred tool call(s); the session stays "
            "open: run the agent again in it with message_history=exc.messages and "
            "deferred_tool_results= (approval_results(...) for approvals)"
        )

    @property
    def messages(self) -> list[ModelMessage]:
        """The run's whole message history, to resume it from."""
        return self.result.all_messages()

    def approval_requests(self) -> dict[str, ApprovalRequest]:
        """The durable tool calls waiting for an approval, by `tool_call_id`."""
        return approval_requests(self.requests)


def approval_requests(requests: DeferredToolRequests) -> dict[str, ApprovalRequest]:
    """The approval requests of durable tool calls among `requests`, by `tool_call_id`
    (calls deferred for other reasons are left out)."""
    found: dict[str, ApprovalRequest] = {}
    for call in requests.approvals:
        metadata = requests.metadata.get(call.tool_call_id)
        if isinstance(metadata, Mapping) and metadata.get("kind") == ApprovalRequest.KIND:
            found[call.tool_call_id] = ApprovalRequest.from_metadata(metadata)
    return found


def approval_results(tokens: Mapping[str, str]) -> DeferredToolResults:
    """`DeferredToolResults` approving each `tool_call_id` with its signed token
    (`sign_approval`); pass them as `agent.run(..., deferred_tool_results=...)`."""
    return DeferredToolResults(
        approvals=dict.fromkeys(tokens, True),
        metadata={call_id: {APPROVAL_TOKEN: token} for call_id, token in tokens.items()},
    )


class DurableTools(AbstractCapability[Any]):
    """A capability that makes every function tool call of its agent's runs an
    operation of the active session (see the module's docstring).

    Pass it when the agent is built (`Agent(..., capabilities=[DurableTools(...)])`),
    so its durable step is registered before a session is entered; give the agent
    `output_type=[..., DeferredToolRequests]` when a tool has a confirm rule.

    Args:
        name: The name the calls are stored under (each an operation
            `<name>.<digest of its key>`); default: the agent's name. One per agent in a
            process, and stable across deployments: calls on record are found by it.
        approval_key: What approval tokens are verified with (the approvers' HMAC
            secret); required as soon as a tool has a confirm rule.
        policies: Policies by tool name, for tools whose metadata you do not control
            (an MCP server's); they win over a tool's metadata.
        fail_on: Run errors that end the session's work for good (e.g.
            `UsageLimitExceeded`): raised as `PermanentError`, so the session compensates
            its calls. Any other run error leaves the session open for the next entry.
    """

    def __init__(
        self,
        *,
        name: str | None = None,
        approval_key: ApprovalKey | None = None,
        policies: Mapping[str, ToolPolicy] | None = None,
        fail_on: tuple[type[BaseException], ...] = (),
    ) -> None:
        super().__init__()
        self._policies: dict[str, ToolPolicy] = {
            tool: check_policy(policy, tool, "DurableTools")
            for tool, policy in (policies or {}).items()
        }
        self._fail_on = check_fail_on(fail_on, "DurableTools")
        self._approval_key = approval_key
        self._seen: dict[str, ToolPolicy] = {}
        self._agent: AbstractAgent[Any, Any] | None = None
        self._calls: ToolCalls | None = None if name is None else self._tool_calls(name)

    @classmethod
    def get_serialization_name(cls) -> str | None:
        """Not built from agent specs: its policies hold functions."""
        return None

    @property
    def tool_calls(self) -> ToolCalls:
        """The `ToolCalls` the agent's calls are made through."""
        if self._calls is None:
            raise SagaDefinitionError(
                "DurableTools has no name yet: pass it to Agent(capabilities=[...]) of an "
                "agent with a name, or give it one (DurableTools(name=...))"
            )
        return self._calls

    def _tool_calls(self, name: str) -> ToolCalls:
        return ToolCalls(
            name,
            approval_key=self._approval_key,
            policy_of=self._policy_of,
            no_effect=_no_effect,
            replay_no_effect=_replay_no_effect,
        )

    # ----- binding and policies -------------------------------------------------------------

    def get_ordering(self) -> CapabilityOrdering | None:
        """Innermost: the durable boundary sits closest to the tools."""
        return CapabilityOrdering(position="innermost")

    def for_agent(self, agent: AbstractAgent[Any, Any]) -> AbstractCapability[Any]:
        """Bind to `agent` (once) and register the calls' durable step."""
        if self._agent is not None and self._agent is not agent:
            raise SagaDefinitionError(
                "this DurableTools belongs to another agent already; give each agent one of "
                "its own (their calls are stored under different names)"
            )
        self._agent = agent
        if self._calls is None:
            if not agent.name:
                raise SagaDefinitionError(
                    "DurableTools needs a stable name to store the tool calls under: give the "
                    "agent one (Agent(name=...)) or pass DurableTools(name=...)"
                )
            self._calls = self._tool_calls(agent.name)
        return self

    def _policy_of_definition(self, tool_def: ToolDefinition) -> ToolPolicy:
        policy = self._policies.get(tool_def.name)
        if policy is not None:
            return policy
        return _policy_in(tool_def.name, tool_def.metadata)

    def _policy_of(self, tool: str) -> ToolPolicy | None:
        """The policy of `tool` as this process knows it (for calls it did not make)."""
        known = self._policies.get(tool) or self._seen.get(tool)
        if known is not None or self._agent is None:
            return known
        found: list[ToolPolicy] = []

        def visit(toolset: AbstractToolset[Any]) -> None:
            if isinstance(toolset, FunctionToolset) and tool in toolset.tools:
                found.append(_policy_in(tool, toolset.tools[tool].metadata))

        for toolset in self._agent.toolsets:
            toolset.apply(visit)
        return found[0] if found else None

    # ----- hooks ----------------------------------------------------------------------------

    async def prepare_tools(
        self, ctx: RunContext[Any], tool_defs: list[ToolDefinition]
    ) -> list[ToolDefinition]:
        """Every function tool sequential; `requires_approval` tools confirmed by token."""
        prepared: list[ToolDefinition] = []
        for tool_def in tool_defs:
            if tool_def.kind not in ("function", "unapproved"):
                prepared.append(tool_def)
                continue
            self._seen[tool_def.name] = self._policy_of_definition(tool_def)
            metadata = dict(tool_def.metadata or {})
            if tool_def.kind == "unapproved":
                metadata[_APPROVAL_REQUIRED] = True
            prepared.append(replace(tool_def, kind="function", sequential=True, metadata=metadata))
        return prepared

    async def wrap_tool_execute(
        self,
        ctx: RunContext[Any],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: ValidatedToolArgs,
        handler: WrapToolExecuteHandler,
    ) -> Any:
        """Make the call an operation of the active session, or defer it for approval."""
        calls = self.tool_calls
        policy = self._policy_of_definition(tool_def)
        metadata = ctx.tool_call_metadata
        token = metadata.get(APPROVAL_TOKEN) if isinstance(metadata, Mapping) else None
        required = bool((tool_def.metadata or {}).get(_APPROVAL_REQUIRED))

        async def execute() -> Any:
            try:
                return await handler(args)
            except SkipToolExecution as skipped:
                return skipped.result
            except (CallDeferred, ApprovalRequired) as exc:
                raise TypeError(
                    f"tool {tool_def.name!r} raised {type(exc).__name__} from its body, after "
                    "its call was recorded: a durable tool defers through its policy's "
                    "confirm rule (or an args_validator), never from its body"
                ) from exc

        try:
            return await calls.call(
                tool_def.name, args, execute, policy=policy, confirm=required, approval=token
            )
        except ApprovalNeeded as needed:
            raise ApprovalRequired(metadata=needed.request.as_metadata()) from None

    async def after_run(
        self, ctx: RunContext[Any], *, result: AgentRunResult[Any]
    ) -> AgentRunResult[Any]:
        """A run that ends with deferred calls raises `AgentRunDeferred`."""
        if isinstance(result.output, DeferredToolRequests):
            raise AgentRunDeferred(result)
        return result

    async def on_run_error(
        self, ctx: RunContext[Any], *, error: BaseException
    ) -> AgentRunResult[Any]:
        """Run errors in `fail_on` fail the session for good (`PermanentError`)."""
        raise run_failure(error, self._fail_on)


def _policy_in(tool: str, metadata: Mapping[str, Any] | None) -> ToolPolicy:
    """The policy a tool's metadata holds (the default policy when it holds none)."""
    policy = (metadata or {}).get(METADATA_KEY)
    if policy is None:
        return _DEFAULT_POLICY
    if not isinstance(policy, ToolPolicy):
        raise SagaDefinitionError(
            f"tool {tool!r}: its metadata[{METADATA_KEY!r}] must be a ToolPolicy "
            f"(metadata=tool_policy(...)), got {policy!r}"
        )
    return policy


def _no_effect(exc: BaseException) -> NoEffect | None:
    """pydantic-ai's "did nothing, tell the model" exceptions, as stored answers."""
    if isinstance(exc, ToolRetryError):
        return NoEffect(_RETRY, _text(exc.tool_retry.content))
    if isinstance(exc, ToolFailedError):
        return NoEffect(_FAILED, _text(exc.tool_failed.content))
    if isinstance(exc, ModelRetry):
        return NoEffect(_RETRY, exc.message)
    if isinstance(exc, ToolFailed):
        return NoEffect(_FAILED, exc.message)
    if isinstance(exc, UnexpectedModelBehavior) and isinstance(exc.__cause__, ModelRetry):
        # Out of retries: the tool asked the model to retry once too often.
        return NoEffect(_RETRY, exc.__cause__.message)
    return None


def _replay_no_effect(answer: NoEffect) -> BaseException:
    return ToolFailed(answer.message) if answer.kind == _FAILED else ModelRetry(answer.message)


def _text(content: Any) -> str:
    return content if isinstance(content, str) else str(content)
