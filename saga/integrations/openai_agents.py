"""OpenAI Agents SDK: every function tool call of an agent run as an operation of a session.

    pip install 'saga-orchestrator[openai-agents]'

`DurableTools` makes an agent's `FunctionTool`s durable. Each call of one, made by a run
inside `async with aorch.session(run_id):` (an `AsyncOrchestrator`'s session), is a
durable call of that session, as `saga.integrations._tool_calls` describes: keyed by
business fields of its arguments (a `ToolPolicy`, never the SDK's `call_id`), run once
per key, replayed with its stored result when the model asks again with a new `call_id`
(in this run, a retried one, or one in another process after a crash), held for an
approval bound to its request hash when its confirm rule holds, and compensated in
reverse when the session fails for good.

    durable = DurableTools("support", approval_key=APPROVERS_KEY)

    @durable.tool(key="{order_id}", volatile=("note",), idempotent=True,
                  compensate=undo_refund, confirm=lambda a: a["amount_cents"] > 10_000)
    def refund(order_id: str, amount_cents: int, note: str = "") -> dict: ...

    agent = Agent(name="support", model=model, tools=[refund])

    async with aorch.session(ticket_id):
        result = await durable.run(agent, prompt)   # AgentRunInterrupted while approvals wait

The SDK's hooks used (openai-agents 0.8 or later, chosen from its source):

- `FunctionTool.on_invoke_tool(ctx, input)` (agents/tool.py): the durable tool is a copy
  of the tool whose invocation is wrapped: the wrapper parses the model's JSON
  arguments, keys the call, and calls the original invocation inside the session's
  durable call, so a replay never reaches it and answers with the stored result. The
  SDK calls it with a `ToolContext` (agents/tool_context.py), whose `tool_call_id` finds
  the approval token that came with the call.
- `function_tool(..., failure_error_function=None)` (agents/tool.py): by default the SDK
  turns a tool's exception into a message for the model, inside `on_invoke_tool`, where
  a durable wrapper would store it as the call's result. `DurableTools.tool` makes the
  `FunctionTool` itself, in place of `@function_tool`, with the errors raised, so a
  failed attempt is retried by its policy and a call that fails for good fails the run
  (and the session compensates). `DurableTools.wrap` takes a `FunctionTool` made
  otherwise, whose invocation must raise its errors likewise.
- `FunctionTool.needs_approval`, a callable `(run_context, arguments, call_id)`
  (agents/tool.py; asked in agents/run_internal/tool_execution.py before the tool
  runs): it holds when the tool's confirm rule (or the tool's own `needs_approval`)
  holds and the call has not succeeded yet; the run then stops with
  `RunResult.interruptions` (agents/result.py), and `DurableTools.run` raises
  `AgentRunInterrupted` with each call's `ApprovalRequest`, so the session block is
  left by an exception and the session stays open for the approved run.
- Resuming: `RunResult.to_state()` and `RunState.approve(item)` (agents/run_state.py),
  then `Runner.run(agent, state)`. `approve` is a boolean per `call_id` and carries no
  data, so the signed tokens travel beside it: `DurableTools.run(agent, state,
  approvals={call_id: token})` checks each token against its call's request, approves
  in the `RunState` only the calls whose token holds (a refused one stays interrupted,
  the reason in `ApprovalRequest.refused`), and hands the tokens to the tools' wrappers
  for this run only (a context variable that the SDK's tool tasks inherit). The wrapper
  checks the token again: a call the SDK releases on `approve()` alone, or on an
  `always_approve`, raises `ApprovalNeeded` and is not made.
- The SDK runs the function tools of one model turn as concurrent tasks and cancels the
  others when one fails (agents/run_internal/tool_execution.py); the session runs its
  calls one at a time, and in a `DurableTools.run` a call that comes after a failed one
  is not started, so no call is cut off mid-effect by a sibling's failure.
- Errors: the SDK re-raises a tool's exception as `UserError(...)` caused by it
  (agents/run_internal/tool_execution.py); `DurableTools.run` raises the saga's own
  error (`PermanentError`, `IdempotencyConflict`, `SessionParked`, `ApprovalNeeded`,
  `OutsideSession`) as the tool raised it, so a `PermanentError` leaves the session
  block and compensates. Run errors listed in `fail_on` (`MaxTurnsExceeded`, ...) are
  raised as `PermanentError` likewise.
- Invalid arguments (`ModelBehaviorError`): for a tool made by `DurableTools.tool`, the
  arguments are validated first, with the model the SDK builds from the function's
  signature (`agents.function_schema.function_schema`): invalid ones are answered to the
  model and nothing is recorded. For a wrapped tool, the SDK's own check runs inside the
  call: the call is stored with that answer (it did nothing), which replays, and its key
  is used.
- `Model` (agents/models/interface.py): any implementation drives a real `Agent`, so the
  integration is tested offline with a scripted model.

Where the SDK falls short: approvals are booleans per `call_id`, not bound to the
arguments, and carry no data (hence the tokens beside them); a tool's error is a message
to the model unless the tool is made to raise it; `FunctionTool.timeout_seconds` cancels
the invocation from outside, which would cut a durable call off mid-effect, so a durable
tool takes its timeout from its policy instead; streamed runs (`Runner.run_streamed`)
make the same durable calls, but only `DurableTools.run` turns interruptions and tool
errors into the session's exceptions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, overload

from agents import (
    Agent,
    FunctionTool,
    ModelBehaviorError,
    RunContextWrapper,
    Runner,
    RunResult,
    RunState,
    ToolApprovalItem,
    TResponseInputItem,
    function_tool,
)
from agents.function_schema import function_schema
from agents.tool_context import ToolContext
from pydantic import BaseModel, ValidationError

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

__all__ = [
    "AgentRunInterrupted",
    "ApprovalNeeded",
    "ApprovalRequest",
    "CallNotStarted",
    "DurableTools",
    "OutsideSession",
    "ToolPolicy",
    "sign_approval",
]

# A stored answer to the model: the SDK refused the call's arguments.
_INVALID_ARGUMENTS = "invalid_arguments"
# `function_tool` options a durable tool takes elsewhere.
_REFUSED_OPTIONS = {
    "failure_error_function": (
        "a durable tool raises its errors: its policy's retry decides what is retried, and "
        "a call that fails for good fails the run (and the session compensates)"
    ),
    "timeout": (
        "the SDK's timeout cancels the call from outside, mid-effect; give the policy "
        "timeout_seconds= instead (an attempt past it has an unknown outcome)"
    ),
}


class AgentRunInterrupted(SagaError):
    """The agent run stopped at tool calls waiting for approval: the session stays open
    for the run that resumes it.

    Attributes:
        result: The run's result; `result.interruptions` are the waiting calls.
        requests: The durable calls among them, each waiting for a token signed for its
            `ApprovalRequest`, by `call_id`.
    """

    def __init__(self, result: RunResult, requests: Mapping[str, ApprovalRequest]) -> None:
        self.result = result
        self.requests: dict[str, ApprovalRequest] = dict(requests)
        refused = sum(1 for request in self.requests.values() if request.refused)
        why = f" ({refused} with a refused token)" if refused else ""
        super().__init__(
            f"the agent run stopped at {len(result.interruptions)} tool call(s) waiting for "
            f"approval, {len(self.requests)} of them durable calls waiting for a signed "
            f"token{why}; the session stays open: sign each exc.approval_requests() with "
            "sign_approval, then run the agent again in the session with "
            "durable.run(agent, exc.state(), approvals={call_id: token})"
        )

    @property
    def interruptions(self) -> list[ToolApprovalItem]:
        """Every call the run stopped at (durable or not), as the SDK lists them."""
        return list(self.result.interruptions)

    def state(self) -> RunState[Any]:
        """A `RunState` to resume the run from (`RunResult.to_state()`); approve calls of
        tools that are not durable in it with `state.approve(item)`."""
        return self.result.to_state()

    def approval_requests(self) -> dict[str, ApprovalRequest]:
        """The durable calls waiting for a signed token, by `call_id`."""
        return dict(self.requests)


@dataclass(eq=False)
class _Run:
    """What one `DurableTools.run` shares with its tools' wrappers."""

    owner: DurableTools
    tokens: dict[str, str] = field(default_factory=dict)
    # Held around each durable call: a call that comes after a failed one is not started.
    gate: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The first exception a durable call of the run raised.
    raised: BaseException | None = None

    def record(self, exc: BaseException) -> None:
        if self.raised is None:
            self.raised = exc


_RUN: ContextVar[_Run | None] = ContextVar("saga.integrations.openai_agents.run", default=None)


class DurableTools:
    """The durable function tools of one agent (see the module's docstring).

    Make it when the agent is defined, at import time, and make its tools with `tool`
    (or `wrap`) there too: a later process (the next entry of a session, `saga compensate
    --app`) finds a call's compensation by its tool's name. Run the agent with `run`,
    inside `async with aorch.session(run_id):`.

    Args:
        name: The name the calls are stored under (each an operation
            `<name>.<digest of its key>`); one per agent in a process, and stable across
            deployments: calls on record are found by it.
        approval_key: What approval tokens are verified with: the approvers'
            `ApprovalVerifier` (their public key), or an HMAC secret (the weaker mode);
            required as soon as a tool has a confirm rule.
        fail_on: Run errors that end the session's work for good (e.g.
            `MaxTurnsExceeded`): `run` raises them as `PermanentError`, so the session
            compensates its calls. Any other run error leaves the session open.
    """

    def __init__(
        self,
        name: str,
        *,
        approval_key: ApprovalKey | None = None,
        fail_on: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._fail_on = check_fail_on(fail_on, "DurableTools")
        self._policies: dict[str, ToolPolicy] = {}
        self._calls = ToolCalls(
            name,
            approval_key=approval_key,
            policy_of=self._policies.get,
            no_effect=_no_effect,
            replay_no_effect=_replay_no_effect,
        )
        self.name: str = self._calls.name

    @property
    def tool_calls(self) -> ToolCalls:
        """The `ToolCalls` the tools' calls are made through."""
        return self._calls

    # ----- making durable tools -------------------------------------------------------------

    @overload
    def tool(self, func: Callable[..., Any], /) -> FunctionTool: ...

    @overload
    def tool(
        self,
        func: None = None,
        /,
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
        **function_tool_options: Any,
    ) -> Callable[[Callable[..., Any]], FunctionTool]: ...

    def tool(
        self,
        func: Callable[..., Any] | None = None,
        /,
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
        **function_tool_options: Any,
    ) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
        """A durable `FunctionTool` of a Python function: use it in place of
        `@function_tool` (`@durable.tool(key="{order_id}", ...)`, or `@durable.tool` for
        a tool keyed by all its arguments).

        The policy's arguments are `ToolPolicy`'s; any other keyword is passed to the
        SDK's `function_tool` (`name_override`, `strict_mode`, `needs_approval`, ...),
        except `failure_error_function` (a durable tool raises its errors) and `timeout`
        (use `timeout_seconds`). A tool declared `needs_approval` waits for a signed token
        like one whose confirm rule holds.
        """
        policy = ToolPolicy(
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
        for option, why in _REFUSED_OPTIONS.items():
            if function_tool_options.get(option) is not None:
                raise SagaDefinitionError(f"DurableTools.tool: {option}= is not taken: {why}")

        def make(fn: Callable[..., Any]) -> FunctionTool:
            if isinstance(fn, FunctionTool):
                raise SagaDefinitionError(
                    f"DurableTools.tool: {fn.name!r} is a FunctionTool already; put "
                    "@durable.tool in place of @function_tool (it takes function_tool's "
                    "options), or make an existing FunctionTool durable with "
                    "durable.wrap(tool) (its invocation must raise its errors)"
                )
            options = {k: v for k, v in function_tool_options.items() if k not in _REFUSED_OPTIONS}
            made = function_tool(fn, failure_error_function=None, **options)
            schema = function_schema(
                fn,
                name_override=made.name,
                use_docstring_info=False,
                strict_json_schema=bool(options.get("strict_mode", True)),
            )
            return self._wrap(made, policy, schema.params_pydantic_model)

        return make if func is None else make(func)

    def wrap(self, tool: FunctionTool, policy: ToolPolicy | None = None) -> FunctionTool:
        """A durable copy of `tool` (`tool` itself is left as it is), its calls made
        under `policy` (keyed by all their arguments without one).

        `tool.on_invoke_tool` must raise its errors: a string it returns is the call's
        result, stored and replayed. A `FunctionTool` made by `function_tool` turns
        errors into strings unless made with `failure_error_function=None`; prefer
        `DurableTools.tool`, which also checks the arguments before a call is recorded.
        """
        if not isinstance(tool, FunctionTool):
            raise SagaDefinitionError(
                f"DurableTools.wrap takes a FunctionTool, got {type(tool).__name__}; only "
                "function tools are made durable (hosted tools run at the model's provider)"
            )
        if policy is None:
            policy = ToolPolicy()
        return self._wrap(tool, check_policy(policy, tool.name, "DurableTools.wrap"), None)

    def _wrap(
        self, tool: FunctionTool, policy: ToolPolicy, validator: type[BaseModel] | None
    ) -> FunctionTool:
        name = tool.name
        if getattr(tool, "timeout_seconds", None) is not None:
            raise SagaDefinitionError(
                f"tool {name!r} has timeout_seconds={tool.timeout_seconds}: "
                f"{_REFUSED_OPTIONS['timeout']}"
            )
        if name in self._policies:
            raise SagaDefinitionError(
                f"DurableTools {self.name!r} has a tool named {name!r} already; a call's "
                "compensation is found by its tool's name: give each tool a name of its own"
            )
        self._policies[name] = policy
        tool_call = _ToolCall(self, tool, policy, validator)
        return dataclasses.replace(
            tool, on_invoke_tool=tool_call.invoke, needs_approval=tool_call.needs_approval
        )

    # ----- running the agent ----------------------------------------------------------------

    async def run(
        self,
        agent: Agent[Any],
        input: str | list[TResponseInputItem] | RunState[Any],
        *,
        approvals: Mapping[str, str] | None = None,
        **runner_options: Any,
    ) -> RunResult:
        """`Runner.run(agent, input, **runner_options)`, with the session's exceptions.

        Run it inside `async with aorch.session(run_id):`.

        Args:
            agent: The agent; its durable tools are this object's.
            input: The prompt, or the `RunState` of an interrupted run
                (`AgentRunInterrupted.state()`) to resume.
            approvals: Signed tokens (`sign_approval`) by `call_id`, for the durable calls
                of the `RunState` that wait for one: a call whose token holds is approved
                in the state; one whose token is refused stays interrupted, the reason in
                its request's `refused`.
            runner_options: Passed to `Runner.run` (`context=`, `max_turns=`,
                `run_config=`, ...).

        Returns:
            The run's result, when it ran to its end.

        Raises:
            AgentRunInterrupted: The run stopped at calls waiting for approval; the
                session stays open.
            PermanentError: A call failed for good, or the run failed with an error in
                `fail_on`: leaving the session block with it compensates.
            ValueError: A token names a `call_id` that does not wait for a durable call's
                approval in `input`.
            SagaError: What a durable call raised (`IdempotencyConflict`, `SessionParked`,
                `ApprovalNeeded`, `OutsideSession`, ...); else the run's own error.
        """
        run = _Run(owner=self)
        refusals: dict[str, str] = {}
        if approvals:
            if not isinstance(input, RunState):
                raise TypeError(
                    "approvals= go with the RunState of the interrupted run: "
                    "durable.run(agent, interrupted.state(), approvals={call_id: token})"
                )
            refusals = self._release(input, approvals, run)
        context = _RUN.set(run)
        failure: BaseException | None = None
        try:
            result = await Runner.run(agent, input, **runner_options)
        except Exception as exc:
            failure = self._failure(exc, run)
        finally:
            _RUN.reset(context)
        if failure is not None:
            raise failure  # outside the handler: the tool's error keeps its own cause
        if result.interruptions:
            raise AgentRunInterrupted(result, self._requests(result.interruptions, refusals))
        return result

    def _current_run(self) -> _Run:
        """The `run` in progress, or one of this call only (`Runner.run` called directly)."""
        run = _RUN.get()
        return run if run is not None and run.owner is self else _Run(owner=self)

    def _release(
        self, state: RunState[Any], approvals: Mapping[str, str], run: _Run
    ) -> dict[str, str]:
        """Approve in `state` each durable call whose token holds, and give the run its
        token; the refusals, by `call_id`."""
        waiting = {_call_id(item): item for item in state.get_interruptions()}
        unknown = sorted(call_id for call_id in approvals if call_id not in waiting)
        if unknown:
            raise ValueError(
                f"no tool call of this RunState waits for an approval under call id(s) "
                f"{unknown}; these do: {sorted(c for c in waiting if c)}"
            )
        refusals: dict[str, str] = {}
        for call_id, token in approvals.items():
            item = waiting[call_id]
            request = self._request_of(item)
            if request is None:
                raise ValueError(
                    f"call {call_id} of tool {item.tool_name!r} is not a durable call of "
                    f"{self.name!r}: approve it in the RunState (state.approve(item))"
                )
            refused = self._calls.approval_refused(request, token)
            if refused is not None:
                refusals[call_id] = refused
                continue
            state.approve(item)
            run.tokens[call_id] = token
        return refusals

    def _requests(
        self, interruptions: Sequence[ToolApprovalItem], refusals: Mapping[str, str]
    ) -> dict[str, ApprovalRequest]:
        requests: dict[str, ApprovalRequest] = {}
        for item in interruptions:
            call_id = _call_id(item)
            request = self._request_of(item, refusals.get(call_id))
            if request is not None:
                requests[call_id] = request
        return requests

    def _request_of(
        self, item: ToolApprovalItem, refused: str | None = None
    ) -> ApprovalRequest | None:
        """The approval request of a durable call the run stopped at (None: not one)."""
        tool = item.tool_name or _field(item.raw_item, "name")
        policy = self._policies.get(tool) if isinstance(tool, str) else None
        if policy is None or not isinstance(tool, str):
            return None
        try:
            arguments = _arguments_of(tool, _field(item.raw_item, "arguments"))
        except ModelBehaviorError:
            return None
        return self._calls.approval_request(tool, arguments, policy=policy, refused=refused)

    def _failure(self, exc: Exception, run: _Run) -> BaseException:
        """What `run` raises for the run's error `exc`."""
        raised = run.raised
        if raised is not None and (
            _caused_by(exc, lambda e: e is raised) or _caused_by(exc, CallNotStarted)
        ):
            return raised  # what the first durable call that failed raised
        return run_failure(exc, self._fail_on)


class _ToolCall:
    """The wrapped invocation and approval hook of one durable tool."""

    def __init__(
        self,
        owner: DurableTools,
        tool: FunctionTool,
        policy: ToolPolicy,
        validator: type[BaseModel] | None,
    ) -> None:
        self._owner = owner
        self._name = tool.name
        self._inner = tool.on_invoke_tool
        self._asks = tool.needs_approval
        self._policy = policy
        self._validator = validator

    async def needs_approval(
        self, ctx: RunContextWrapper[Any], arguments: dict[str, Any], call_id: str
    ) -> bool:
        """The SDK's approval hook: whether this call waits for a signed token."""
        if self._asks is False and self._policy.confirm is False:
            return False
        run = self._owner._current_run()
        try:
            if self._invalid(arguments) is not None:
                return False  # the invocation answers the model; nothing waits
            confirm = await self._confirm(ctx, arguments, call_id)
            return await self._owner.tool_calls.needs_approval(
                self._name, arguments, policy=self._policy, confirm=confirm
            )
        except BaseException as exc:
            run.record(exc)
            raise

    async def invoke(self, ctx: ToolContext[Any], input: str) -> Any:
        """The SDK's invocation: the call as an operation of the active session."""
        run = self._owner._current_run()
        async with run.gate:
            if run.raised is not None:
                raise CallNotStarted(
                    f"tool {self._name!r} (call {ctx.tool_call_id}) was not called: an "
                    f"earlier call of this run failed ({type(run.raised).__name__})"
                )
            try:
                arguments = _arguments_of(self._name, input)
                invalid = self._invalid(arguments)
                if invalid is not None:
                    return invalid
                confirm = await self._confirm(ctx, arguments, ctx.tool_call_id)
                inner = self._inner

                async def execute() -> Any:
                    return await inner(ctx, input)

                return await self._owner.tool_calls.call(
                    self._name,
                    arguments,
                    execute,
                    policy=self._policy,
                    confirm=confirm,
                    approval=run.tokens.get(ctx.tool_call_id),
                )
            except ModelBehaviorError as refused:
                return str(refused)  # the arguments were refused: the model is told
            except BaseException as exc:
                run.record(exc)
                raise

    async def _confirm(
        self, ctx: RunContextWrapper[Any], arguments: dict[str, Any], call_id: str
    ) -> bool:
        """The tool's own `needs_approval` for this call."""
        asks = self._asks
        if isinstance(asks, bool):
            return asks
        verdict: Any = asks(ctx, arguments, call_id)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        return bool(verdict)

    def _invalid(self, arguments: dict[str, Any]) -> str | None:
        """What the model is told when the arguments do not fit the function (None: they
        do, or the tool was not made from a function here)."""
        if self._validator is None:
            return None
        try:
            self._validator(**arguments)
        except ValidationError as exc:
            return f"Invalid JSON input for tool {self._name}: {exc}"
        return None


class CallNotStarted(SagaError):
    """A durable call of an agent run was not started, because an earlier call of the
    same run failed (the run fails with that call's error)."""


def _arguments_of(tool: str, text: Any) -> dict[str, Any]:
    """The model's arguments of a call (a JSON object); `ModelBehaviorError` otherwise."""
    if text is None or text == "":
        return {}
    try:
        parsed = json.loads(text) if isinstance(text, str | bytes) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ModelBehaviorError(f"Invalid JSON input for tool {tool}: expected a JSON object")
    return parsed


def _field(raw: Any, name: str) -> Any:
    return raw.get(name) if isinstance(raw, Mapping) else getattr(raw, name, None)


def _call_id(item: ToolApprovalItem) -> str:
    call_id = _field(item.raw_item, "call_id")
    return call_id if isinstance(call_id, str) else ""


def _caused_by(
    exc: BaseException, what: type[BaseException] | Callable[[BaseException], bool]
) -> bool:
    """Whether `exc`, or an exception in its chain of causes and contexts, is `what` (an
    exception class, or a test)."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if isinstance(what, type) and isinstance(current, what):
            return True
        if not isinstance(what, type) and what(current):
            return True
        if id(current) in seen:
            continue
        seen.add(id(current))
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return False


def _no_effect(exc: BaseException) -> NoEffect | None:
    """The SDK refused the call's arguments before the tool ran: it did nothing."""
    if isinstance(exc, ModelBehaviorError):
        return NoEffect(_INVALID_ARGUMENTS, str(exc))
    return None


def _replay_no_effect(answer: NoEffect) -> BaseException:
    return ModelBehaviorError(answer.message)
