"""An agent's tool calls as operations of a session, for any agent framework.

This module knows no agent framework: each integration (`saga.integrations.pydantic_ai`,
and any later one) adapts its framework's hooks to what is here, so that every framework
keys, stores, replays, confirms and compensates tool calls the same way.

What one tool call becomes
--------------------------
Inside `async with aorch.session(run_id) as run:` (an `AsyncOrchestrator`'s session), a
tool call is one call of a durable step of the session (`AsyncSession.call`):

- **Its key comes from business fields.** A `ToolPolicy` names them in a key template
  (`key="{order_id}"`) or a function of the arguments; without one, the key is the
  canonical JSON of the call's arguments minus its `volatile` fields. It is never the
  model's `tool_call_id` (new on every turn) and never a hash of arguments that change
  from one turn to the next. The call's key in the session is `<tool>:<rendered key>`.
- **Its request hash covers the business fields** (every argument but the `volatile`
  ones), so the same key with another amount is an `IdempotencyConflict`, refused before
  anything runs, and a reworded note (a volatile field) is the same request.
- **Once per key.** The first call runs the tool (`running` committed before, the
  outcome after); a later call under the same key, with a new `tool_call_id`, in this or
  a later process, returns the stored result: the model sees what the first call
  returned. A call cut off by a crash is settled when the agent makes it again: by the
  policy's `reconcile` hook (`Found` / `Absent` / `Inconclusive`), else by a same-key
  retry when the tool is `idempotent` (the provider dedupes on
  `saga.current_context().idempotency_key`), else the session parks for a human.
- **Confirmation.** When the policy's `confirm` rule holds for a call that has not
  succeeded yet, the call runs only with an approval token bound to the session, the
  call's operation and its request hash (`saga.approvals`): without one, or with one that
  is forged, expired or bound to other arguments, `ToolCalls.call` raises
  `ApprovalNeeded`, carrying the `ApprovalRequest` an approver signs
  (`sign_approval`), and the framework defers the call. Changed arguments are another
  request hash: they need a new approval. A token can release one execution at most:
  once the call succeeded, its key replays.
- **Compensation.** The policy's `compensate` is the call's compensation: when the
  session fails for good (a `PermanentError` leaving the block, or `run.fail()`), the
  succeeded calls are compensated in reverse, durably, each once.
- **Answers that did nothing.** A framework signals "the tool did nothing, tell the
  model" with exceptions of its own (pydantic-ai's `ModelRetry`, `ToolFailed`). The
  adapter's `no_effect` classifier names them; such a call is stored with that answer
  (a JSON marker, see `NoEffect`), which replays as the same exception, and is never
  compensated. Its key is used: the same key with corrected arguments is a conflict, so
  checks that send the model back belong before execution (a framework's argument
  validator).

The functions the policy names get the call's stored arguments, as JSON (models as
objects) and without the volatile fields: `reconcile(ctx, arguments)`,
`compensate(ctx, result, arguments)` (`result` is None when the call's outcome was
unknown), each sync (run in a thread) or async. `ctx` is the `StepContext`
(`ctx.idempotency_key`...). Tool results must be JSON, or what
`pydantic_core.to_jsonable_python` makes JSON (models, dataclasses); a result that is
not parks the session (its effect happened; it is never run again).

Writing an adapter
------------------
1. Make one `ToolCalls(name, ...)` per agent, at import time (when the agent is
   defined): it registers a durable step under `name`, through which a later process
   (the next entry of a session, `saga compensate --app`) finds the calls'
   compensations. Give it `policy_of`, which finds a tool's policy by name then (from
   the agent's tool definitions), `no_effect` / `replay_no_effect` for the framework's
   "tell the model" exceptions, and the `approval_key`.
2. Around each tool invocation, `await calls.call(tool, arguments, execute, policy=...,
   approval=token)`, where `execute` runs the tool (and what the framework wraps around
   it) and returns its result. Turn `ApprovalNeeded` into the framework's deferral,
   with `exc.request.as_metadata()` for the approver; let everything else propagate.
3. Execute the calls of a session one at a time (the session runs them one at a time
   anyway; sibling calls cancelled mid-call would leave unknown outcomes).
4. Approvers: `ApprovalRequest.from_metadata(...)`, then `sign_approval(key, request,
   actor=..., ttl_seconds=...)`, which first checks that the request's hash is that of
   the arguments it shows; the token goes back with the framework's approval.
5. A framework that decides before the invocation whether a call waits for an approval
   (a `needs_approval` hook, asked before the tool's wrapper runs) asks
   `calls.needs_approval(...)`, shows `calls.approval_request(...)` to the approver, and
   may check a token with `calls.approval_refused(...)` before releasing the call;
   `ToolCalls.call` checks the token again, whatever the framework decided.
6. An adapter's `fail_on` (run errors that end the session's work for good) is checked
   with `check_fail_on`; a run error is raised as `run_failure(error, fail_on)` says.
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeAlias

from pydantic_core import PydanticSerializationError, to_jsonable_python

from saga import approvals
from saga.context import StepContext
from saga.durable import DurableStep, active_session, durable_step, registered_step
from saga.errors import PermanentError, SagaDefinitionError, SagaError
from saga.keys import JsonValue, canonical_json, check_json
from saga.retry import RetryPolicy
from saga.session import AsyncSession, call_long_name, call_step_name
from saga.signatures import describe_callable, is_async

__all__ = [
    "ApprovalKey",
    "ApprovalNeeded",
    "ApprovalRequest",
    "NoEffect",
    "OutsideSession",
    "ToolCall",
    "ToolCalls",
    "ToolPolicy",
    "sign_approval",
]

# What approvals are verified (and, on the approvers' side, signed) with: the approvers'
# Ed25519 key (an `ApprovalVerifier` holding only the public key, where the agent runs;
# an `ApprovalSigner` where approvals are made), or, as a weaker mode, an HMAC secret
# shared by approvers and the process running the agent (which can then sign too).
ApprovalKey: TypeAlias = "bytes | approvals.ApprovalSigner | approvals.ApprovalVerifier"

# A tool's confirm rule: always, never, or a function of the call's arguments (as JSON).
ConfirmRule: TypeAlias = bool | Callable[[dict[str, Any]], bool]
# A key function: the call's stored arguments (JSON, volatile fields left out) -> its key.
KeyFunction: TypeAlias = Callable[[dict[str, Any]], str]

# The marker a call that did nothing is stored as: {NO_EFFECT: {"kind": ..., "message": ...}}.
NO_EFFECT = "$saga_no_effect"
# History events after which an operation holds a result (a later call of it replays).
_SUCCEEDED_EVENTS = ("attempt_succeeded", "reconcile_found")


class OutsideSession(SagaError, RuntimeError):
    """A durable tool was called outside an `AsyncOrchestrator`'s session."""


class ApprovalNeeded(SagaError):
    """A tool call's confirm rule holds and no valid approval came with it: the call was
    not made. `request` is what an approver signs; `request.refused` says why a token
    that came with the call was refused (None when none came)."""

    def __init__(self, request: ApprovalRequest) -> None:
        self.request = request
        why = f": {request.refused}" if request.refused else ""
        super().__init__(
            f"tool {request.tool!r} under key {request.key!r} in session {request.saga_id} "
            f"waits for an approval of request {request.request_hash}{why}"
        )


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """How the calls of one tool are keyed, settled, confirmed and compensated.

    Attributes:
        key: The key template (`"{order_id}"`, `"{order_id}/{line}"`): each `{name}` is
            an argument, a str put in as is and anything else as canonical JSON; or a
            function of the call's stored arguments returning a str. None: the
            canonical JSON of the stored arguments. Choose separators the values cannot
            hold: two calls whose keys collide with other arguments are refused as a
            conflict, never merged.
        volatile: Arguments that do not change what the call does (a note, a
            timestamp): left out of the stored arguments, the key and the request hash.
            The tool still receives them.
        idempotent: The provider dedupes on `ctx.idempotency_key`, so a call cut off by a
            crash may be retried under the same key.
        reconcile: `(ctx, arguments) -> Found | Absent | Inconclusive`: asked, by key,
            whether a call whose outcome is unknown happened.
        compensate: `(ctx, result, arguments) -> None`: undoes a succeeded call when the
            session fails for good (`result` is None when its outcome was unknown).
        confirm: True, or a function of the call's arguments (all of them, as JSON),
            when a call must wait for an approval bound to its request hash.
        retry: Retry policy of the call's attempts (`RetryPolicy()` by default).
        compensation_retry: Retry policy of the compensation's attempts.
        compensation_idempotent: The compensation's provider dedupes on its
            `ctx.idempotency_key`.
        timeout_seconds: Longest attempt; one past it has an unknown outcome.
    """

    key: str | KeyFunction | None = None
    volatile: tuple[str, ...] = ()
    idempotent: bool = False
    reconcile: Callable[..., Any] | None = None
    compensate: Callable[..., Any] | None = None
    confirm: ConfirmRule = False
    retry: RetryPolicy | None = None
    compensation_retry: RetryPolicy | None = None
    compensation_idempotent: bool = False
    timeout_seconds: float | None = None
    # The argument names the key template uses (computed).
    key_fields: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        volatile = self.volatile
        if isinstance(volatile, str) or not all(isinstance(v, str) for v in volatile):
            raise SagaDefinitionError(
                f"tool policy: volatile must be a tuple of argument names, got {volatile!r}"
            )
        object.__setattr__(self, "volatile", tuple(volatile))
        if isinstance(self.key, str):
            fields = _template_fields(self.key)
            both = sorted(set(fields) & set(self.volatile))
            if both:
                raise SagaDefinitionError(
                    f"tool policy: key template {self.key!r} uses {both}, which are volatile; "
                    "a key is made of business fields (drop them from volatile or the key)"
                )
            object.__setattr__(self, "key_fields", fields)
        elif self.key is not None and not callable(self.key):
            raise SagaDefinitionError(
                f"tool policy: key must be a template str or a function, got {self.key!r}"
            )
        if not (isinstance(self.confirm, bool) or callable(self.confirm)):
            raise SagaDefinitionError(
                f"tool policy: confirm must be a bool or a function of the arguments, "
                f"got {self.confirm!r}"
            )
        for name in ("reconcile", "compensate"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise SagaDefinitionError(f"tool policy: {name} must be a function, got {hook!r}")
        for name in ("retry", "compensation_retry"):
            policy = getattr(self, name)
            if policy is not None and not isinstance(policy, RetryPolicy):
                raise SagaDefinitionError(
                    f"tool policy: {name} must be a RetryPolicy, got {policy!r}"
                )
        timeout = self.timeout_seconds
        if timeout is not None and not (
            isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0
        ):
            raise SagaDefinitionError(
                f"tool policy: timeout_seconds must be a positive number, got {timeout!r}"
            )

    def needs_confirmation(self, tool: str, arguments: dict[str, Any]) -> bool:
        """Whether the confirm rule holds for a call of `tool` with these arguments."""
        if isinstance(self.confirm, bool):
            return self.confirm
        try:
            return bool(self.confirm(arguments))
        except Exception as exc:
            raise TypeError(
                f"tool {tool!r}: its confirm rule {describe_callable(self.confirm)} raised "
                f"{type(exc).__name__}: {exc}; nothing was called"
            ) from exc

    def key_of(self, tool: str, arguments: dict[str, Any]) -> str:
        """The call's key in the session: `<tool>:<rendered key>`, from its stored
        arguments. `TypeError` names what is missing or wrong, before anything runs."""
        if self.key is None:
            return f"{tool}:{canonical_json(arguments)}"
        if isinstance(self.key, str):
            missing = [name for name in self.key_fields if name not in arguments]
            if missing:
                raise TypeError(
                    f"tool {tool!r}: its key template {self.key!r} names {missing}, which "
                    f"the call's arguments do not have (it has {sorted(arguments)})"
                )
            rendered = self.key.format_map(
                {name: _key_part(arguments[name]) for name in self.key_fields}
            )
            return f"{tool}:{rendered}"
        try:
            rendered = self.key(arguments)
        except Exception as exc:
            raise TypeError(
                f"tool {tool!r}: its key function {describe_callable(self.key)} raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(rendered, str):
            raise TypeError(
                f"tool {tool!r}: its key function must return a str, got "
                f"{type(rendered).__name__} {rendered!r}"
            )
        return f"{tool}:{rendered}"


def _template_fields(template: str) -> tuple[str, ...]:
    """The argument names of a key template; `SagaDefinitionError` for anything but
    plain `{name}` fields, or for a template that names none."""
    fields: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise SagaDefinitionError(f"tool policy: key template {template!r}: {exc}") from None
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise SagaDefinitionError(
                f"tool policy: key template {template!r}: {{{name}}} must name an argument "
                "as a plain {name} (no index, attribute, conversion or format spec)"
            )
        fields.append(name)
    if not fields:
        raise SagaDefinitionError(
            f"tool policy: key template {template!r} names no argument, so every call of "
            "the tool would have the same key; name the business fields, e.g. '{order_id}'"
        )
    return tuple(dict.fromkeys(fields))


def _key_part(value: JsonValue) -> str:
    return value if isinstance(value, str) else canonical_json(value)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call as the session's ledger knows it.

    Attributes:
        tool: The tool's name.
        key: The call's key in the session (`<tool>:<rendered key>`).
        operation: The operation's name in the session (`saga show` lists it).
        arguments: The stored arguments (JSON, volatile fields left out).
        request_hash: Hash of step, key and stored arguments: what an approval is
            bound to.
    """

    tool: str
    key: str
    operation: str
    arguments: dict[str, Any]
    request_hash: str


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """What an approver of one tool call is shown, and signs (`sign_approval`).

    Attributes:
        saga_id: The session's saga id.
        step: The call's operation name in the session.
        request_hash: The call's request hash: an approval is bound to it.
        tool: The tool's name.
        key: The call's key in the session.
        arguments: The arguments the approval covers (the volatile ones left out).
        refused: Why a token that came with the call was refused, or None.
    """

    saga_id: str
    step: str
    request_hash: str
    tool: str
    key: str
    arguments: dict[str, Any]
    refused: str | None = None

    # The metadata's marker, so an adapter tells our requests from other deferrals.
    KIND = "saga.tool_call_approval"

    def as_metadata(self) -> dict[str, Any]:
        """The request as JSON, for the framework's deferral metadata."""
        return {"kind": self.KIND, **asdict(self)}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ApprovalRequest:
        """The request `as_metadata` wrote; `ValueError` for anything else."""
        if not isinstance(metadata, Mapping) or metadata.get("kind") != cls.KIND:
            raise ValueError(
                f"not the approval request of a durable tool call: {metadata!r} (it has no "
                f"kind {cls.KIND!r})"
            )
        try:
            request = cls(
                saga_id=metadata["saga_id"],
                step=metadata["step"],
                request_hash=metadata["request_hash"],
                tool=metadata["tool"],
                key=metadata["key"],
                arguments=dict(metadata["arguments"]),
                refused=metadata.get("refused"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a malformed approval request: {metadata!r} ({exc})") from None
        for name in ("saga_id", "step", "request_hash", "tool", "key"):
            if not isinstance(getattr(request, name), str):
                raise ValueError(f"a malformed approval request: {name} is not a str")
        return request


def _approval_key(key: ApprovalKey) -> ApprovalKey:
    """`key` checked: an `ApprovalVerifier`, an `ApprovalSigner`, or non-empty HMAC bytes."""
    if isinstance(key, approvals.ApprovalSigner | approvals.ApprovalVerifier):
        return key
    if not isinstance(key, bytes) or not key:
        raise SagaDefinitionError(
            "an approval key is the approvers' public key (saga.approvals.ApprovalVerifier), "
            "their ApprovalSigner, or non-empty bytes (an HMAC secret, the weaker mode); got "
            f"{type(key).__name__}"
        )
    return key


def sign_approval(
    key: ApprovalKey,
    request: ApprovalRequest,
    *,
    actor: str,
    ttl_seconds: float,
    now: float | None = None,
) -> str:
    """A token approving exactly this call (session, operation, request hash), by
    `actor`, valid for `ttl_seconds`: what an approver hands back with the approval.

    Raises:
        ValueError: The request's operation or hash is not that of the tool, key and
            arguments it shows: what would be signed is not what the approver sees.
    """
    _check_shown(request)
    key = _approval_key(key)
    if isinstance(key, approvals.ApprovalVerifier):
        raise SagaDefinitionError(
            "a public key verifies approvals but cannot sign them: sign with the approvers' "
            "ApprovalSigner (its private key)"
        )
    if isinstance(key, approvals.ApprovalSigner):
        return key.approval(
            request.saga_id,
            request.step,
            request.request_hash,
            actor=actor,
            ttl_seconds=ttl_seconds,
            now=now,
        )
    return approvals.sign(
        key,
        saga_id=request.saga_id,
        step=request.step,
        request_hash=request.request_hash,
        actor=actor,
        ttl_seconds=ttl_seconds,
        now=now,
    )


def _shown(tool: str, arguments: dict[str, Any]) -> None:
    """The shape of a tool call's durable step, to recompute a shown call's identity."""


def _check_shown(request: ApprovalRequest) -> None:
    """Raise `ValueError` unless `request`'s operation and request hash are those of the
    tool, key and arguments it shows (computed as the session computes them)."""
    name = request.step.rpartition(".")[0]
    try:
        step: DurableStep[Any, Any] = DurableStep(
            _shown, name=name, key=lambda tool, arguments: request.key
        )
        call = step.call_of((request.tool, request.arguments), {})
    except (SagaDefinitionError, TypeError) as exc:
        raise ValueError(f"the approval request cannot be checked: {exc}") from None
    names = (call_step_name(step, call.key), call_long_name(step, call.key))
    if request.step not in names or call.request_hash != request.request_hash:
        raise ValueError(
            f"the approval request of tool {request.tool!r} names operation {request.step!r} "
            f"and request hash {request.request_hash!r}, which are not those of the key and "
            "arguments it shows; refusing to sign what is not shown"
        )


def _refusal(key: ApprovalKey, token: str, saga_id: str, call: ToolCall) -> str | None:
    """Why `token` does not approve `call` in session `saga_id` (None: it does)."""
    step, request_hash = call.operation, call.request_hash
    try:
        if isinstance(key, approvals.ApprovalSigner | approvals.ApprovalVerifier):
            verifier = key.verifier() if isinstance(key, approvals.ApprovalSigner) else key
            verifier.verify(token, saga_id=saga_id, step=step, request_hash=request_hash)
        else:
            approvals.verify(key, token, saga_id=saga_id, step=step, request_hash=request_hash)
    except approvals.ApprovalRejected as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class NoEffect:
    """A call's answer to the model when it did nothing (a retry prompt, a failure the
    model should adapt to). `kind` is the adapter's name for the framework's exception
    (e.g. "retry", "failed"), `message` what the model is told."""

    kind: str
    message: str

    def as_result(self) -> dict[str, Any]:
        """The result the call is stored with."""
        return {NO_EFFECT: {"kind": self.kind, "message": self.message}}

    @classmethod
    def of_result(cls, result: Any) -> NoEffect | None:
        """The answer a stored result holds, or None when it is a tool's own result."""
        if not (isinstance(result, dict) and len(result) == 1 and NO_EFFECT in result):
            return None
        body = result[NO_EFFECT]
        if not isinstance(body, dict):
            return None
        return cls(kind=str(body.get("kind", "")), message=str(body.get("message", "")))


@dataclass(slots=True)
class _Pending:
    """The call in progress, for the durable step's function: how to run the tool, and
    the exception a call that did nothing raised (re-raised as it was, in this process)."""

    execute: Callable[[], Awaitable[Any]]
    raised: BaseException | None = None


_PENDING: ContextVar[_Pending | None] = ContextVar("saga.integrations.tool_call", default=None)


def _jsonable(value: Any) -> Any:
    """`value` as JSON when pydantic can make it so (models, dataclasses, dates); as it
    is otherwise, for the step's result codec to refuse with a message."""
    try:
        return to_jsonable_python(value)
    except (PydanticSerializationError, TypeError, ValueError):
        return value


class ToolCalls:
    """The tool calls of one agent, made as operations of the active session.

    Made once per agent, when it is defined: it registers a durable step named `name`,
    so a later process finds the compensation of a call it did not make itself (the next
    entry of a session, `saga compensate --app`). Two agents of one process need two
    names (`SagaDefinitionError` otherwise).

    Args:
        name: The durable step's name (1 to 100 letters, digits, '_', '-' or '.'); each
            call is an operation `<name>.<digest of its key>` of the session.
        approval_key: What approvals of the tools' confirm rules are verified with;
            None refuses every call whose confirm rule holds.
        policy_of: The policy of a tool by name, or None: how a process that did not
            make a call finds its compensation.
        no_effect: The framework's "did nothing, tell the model" exceptions, as a
            `NoEffect` (None for any other exception).
        replay_no_effect: The exception to raise again when such a call is replayed.
    """

    def __init__(
        self,
        name: str,
        *,
        approval_key: ApprovalKey | None = None,
        policy_of: Callable[[str], ToolPolicy | None] | None = None,
        no_effect: Callable[[BaseException], NoEffect | None] | None = None,
        replay_no_effect: Callable[[NoEffect], BaseException] | None = None,
    ) -> None:
        if (no_effect is None) != (replay_no_effect is None):
            raise SagaDefinitionError(
                f"tool calls {name!r}: no_effect and replay_no_effect go together (what a "
                "call that did nothing is stored as, and what its replay raises)"
            )
        self.approval_key = None if approval_key is None else _approval_key(approval_key)
        self._policy_of = policy_of or (lambda tool: None)
        self._no_effect = no_effect or (lambda exc: None)
        self._replay_no_effect = replay_no_effect
        self._steps: dict[str, tuple[ToolPolicy, DurableStep[Any, Any]]] = {}
        self._run = self._make_run()
        self.step: DurableStep[Any, Any] = self._register(name)
        self.name: str = self.step.name

    # ----- the durable step -----------------------------------------------------------------

    def _make_run(self) -> Callable[..., Awaitable[Any]]:
        no_effect = self._no_effect

        async def run_tool(tool: str, arguments: dict[str, Any]) -> Any:
            """Run the tool call in progress (its `_Pending`); a call that did nothing
            returns its answer's marker."""
            pending = _PENDING.get()
            if pending is None:
                raise PermanentError(
                    f"tool {tool!r}: its calls are made by its agent's run (ToolCalls.call), "
                    "not by calling the durable step; nothing was called"
                )
            try:
                value = await pending.execute()
            except Exception as exc:
                answer = no_effect(exc)
                if answer is None:
                    raise
                pending.raised = exc
                return answer.as_result()
            return _jsonable(value)

        return run_tool

    def _register(self, name: str) -> DurableStep[Any, Any]:
        """The durable step registered under `name` for these calls."""
        existing = registered_step(name)
        if existing is not None:
            raise SagaDefinitionError(
                f"tool calls {name!r}: the durable step name {name!r} is already used by "
                f"{existing!r}; give each agent's tool calls a name of their own"
            )
        step: DurableStep[Any, Any] = durable_step(name=name)(self._run)
        step.compensation(retry=RetryPolicy(max_attempts=5))(self._any_compensation())
        return step

    def _any_compensation(self) -> Callable[..., Awaitable[None]]:
        """The registered step's compensation: that of the call's tool, found by name in
        a process that did not make the call."""

        async def compensate(
            ctx: StepContext, result: Any, tool: str, arguments: dict[str, Any]
        ) -> None:
            policy = self._policy_of(tool)
            if policy is None:
                raise PermanentError(
                    f"the compensation of tool {tool!r} (tool calls {self.name!r}) cannot run "
                    f"in this process: no policy of a tool {tool!r} is known here; import the "
                    "module that defines the agent and its tools, then compensate again"
                )
            await _compensate(policy.compensate, ctx, result, arguments)

        return compensate

    def _step_for(self, tool: str, policy: ToolPolicy) -> DurableStep[Any, Any]:
        """The durable step that runs calls of `tool` under `policy`: the registered
        step's name and function, with the tool's options and hooks."""
        cached = self._steps.get(tool)
        if cached is not None and cached[0] is policy:
            return cached[1]

        def key(tool: str, arguments: dict[str, Any]) -> str:
            return policy.key_of(tool, arguments)

        step: DurableStep[Any, Any] = DurableStep(
            self._run,
            name=self.name,
            key=key,
            retry=policy.retry,
            idempotent=policy.idempotent,
            timeout_seconds=policy.timeout_seconds,
        )
        if policy.compensate is not None:
            fn = policy.compensate

            async def compensate(
                ctx: StepContext, result: Any, tool: str, arguments: dict[str, Any]
            ) -> None:
                await _compensate(fn, ctx, result, arguments)

            step.compensation(
                retry=policy.compensation_retry, idempotent=policy.compensation_idempotent
            )(compensate)
        if policy.reconcile is not None:
            check = policy.reconcile

            async def reconcile(ctx: StepContext, tool: str, arguments: dict[str, Any]) -> Any:
                return await _call(check, ctx, arguments)

            step.reconcile(reconcile)
        self._steps[tool] = (policy, step)
        return step

    # ----- one call -------------------------------------------------------------------------

    def identify(self, tool: str, arguments: Mapping[str, Any], policy: ToolPolicy) -> ToolCall:
        """The call's key, operation, stored arguments and request hash, computed before
        anything runs. `TypeError` when an argument is not JSON or the key cannot be made."""
        return self._identify(tool, _json_arguments(tool, arguments), policy)

    def _identify(self, tool: str, full: dict[str, Any], policy: ToolPolicy) -> ToolCall:
        stored = {name: value for name, value in full.items() if name not in policy.volatile}
        step = self._step_for(tool, policy)
        durable = step.call_of((tool, stored), {})
        return ToolCall(
            tool=tool,
            key=durable.key,
            operation=call_step_name(step, durable.key),
            arguments=stored,
            request_hash=durable.request_hash,
        )

    async def call(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        execute: Callable[[], Awaitable[Any]],
        *,
        policy: ToolPolicy,
        confirm: bool = False,
        approval: str | None = None,
    ) -> Any:
        """Make one tool call as an operation of the active session, or replay it.

        Args:
            tool: The tool's name.
            arguments: The call's validated arguments, by name.
            execute: Runs the tool (and what the framework wraps around it); called at
                most once per attempt, never on a replay.
            policy: The tool's policy.
            confirm: The framework itself asks for an approval of every call of this
                tool (in addition to `policy.confirm`).
            approval: The approval token that came with the call, if any.

        Returns:
            The call's result as stored (JSON), its objects' keys in sorted order (the
            database keeps them in an order of its own): the same, to its text, on the
            first call and on every replay.

        Raises:
            OutsideSession: No `AsyncOrchestrator` session is active.
            ApprovalNeeded: The confirm rule holds and `approval` does not approve this
                call; nothing was called.
            IdempotencyConflict: The key was used with other business arguments.
            SessionParked: The call's outcome is unknown and cannot be settled here.
        """
        session = _active_session(tool)
        full = _json_arguments(tool, arguments)
        call = self._in_session(session, self._identify(tool, full, policy), policy)
        if await self._needs_token(session, call, full, policy, confirm):
            self._check_approval(session.id, call, approval)
        pending = _Pending(execute)
        token = _PENDING.set(pending)
        try:
            result = await session.call(self._step_for(tool, policy), (tool, call.arguments), {})
        finally:
            _PENDING.reset(token)
        answer = NoEffect.of_result(result)
        if answer is None:
            return _in_key_order(result)
        if pending.raised is not None:
            raise pending.raised  # this very call: the framework's own exception
        if self._replay_no_effect is None:
            raise SagaDefinitionError(
                f"tool {tool!r}: the call is stored as an answer to the model ({answer.kind}: "
                f"{answer.message}), and these tool calls have no replay_no_effect to raise it"
            )
        raise self._replay_no_effect(answer)

    async def needs_approval(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        policy: ToolPolicy,
        confirm: bool = False,
    ) -> bool:
        """Whether this call may run only with an approval token: its confirm rule holds
        (or `confirm`, the framework's own "needs approval"), and it has not succeeded in
        the active session yet (a call that has replays without one). For a framework
        that asks before the invocation; `call` decides the same way.

        Raises:
            OutsideSession: No `AsyncOrchestrator` session is active.
            TypeError: An argument is not JSON, the key cannot be made, or the confirm
                rule raised.
        """
        session = _active_session(tool)
        full = _json_arguments(tool, arguments)
        call = self._in_session(session, self._identify(tool, full, policy), policy)
        return await self._needs_token(session, call, full, policy, confirm)

    def _in_session(self, session: AsyncSession, call: ToolCall, policy: ToolPolicy) -> ToolCall:
        """`call` with the name of its operation in `session` (short, unless another
        key's call has that name)."""
        name = session.operation_name(self._step_for(call.tool, policy), call.key)
        return call if name == call.operation else replace(call, operation=name)

    async def _needs_token(
        self,
        session: AsyncSession,
        call: ToolCall,
        full: dict[str, Any],
        policy: ToolPolicy,
        confirm: bool,
    ) -> bool:
        if not (confirm or policy.needs_confirmation(call.tool, full)):
            return False
        return not await _succeeded(session, call.operation)

    def approval_request(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        policy: ToolPolicy,
        refused: str | None = None,
    ) -> ApprovalRequest:
        """What an approver of this call, in the active session, is shown and signs
        (`refused`: why a token that came with it was refused).

        Raises:
            OutsideSession: No `AsyncOrchestrator` session is active.
            TypeError: An argument is not JSON, or the key cannot be made.
        """
        session = _active_session(tool)
        call = self._in_session(session, self.identify(tool, arguments, policy), policy)
        return _request(session.id, call, refused)

    def approval_refused(self, request: ApprovalRequest, token: object) -> str | None:
        """Why `token` does not approve the call `request` shows (None: it does): it is
        not a str, or it is forged, expired, or bound to another session, operation or
        request hash."""
        call = ToolCall(
            tool=request.tool,
            key=request.key,
            operation=request.step,
            arguments=request.arguments,
            request_hash=request.request_hash,
        )
        return self._token_refusal(request.saga_id, call, token)

    def _token_refusal(self, saga_id: str, call: ToolCall, token: object) -> str | None:
        if self.approval_key is None:
            raise SagaDefinitionError(
                f"tool {call.tool!r}: its confirm rule holds for this call, and no approval "
                "key was given to check an approval with; configure one (approval_key=)"
            )
        if not isinstance(token, str):
            return f"the approval token must be a str, got {type(token).__name__}"
        return _refusal(self.approval_key, token, saga_id, call)

    def _check_approval(self, saga_id: str, call: ToolCall, token: str | None) -> None:
        """Return when `token` approves `call`; raise `ApprovalNeeded` otherwise."""
        refused = None
        if token is not None or self.approval_key is None:
            refused = self._token_refusal(saga_id, call, token)
            if refused is None:
                return
        raise ApprovalNeeded(_request(saga_id, call, refused))


def _request(saga_id: str, call: ToolCall, refused: str | None) -> ApprovalRequest:
    """The approval request of `call` in session `saga_id`."""
    return ApprovalRequest(
        saga_id=saga_id,
        step=call.operation,
        request_hash=call.request_hash,
        tool=call.tool,
        key=call.key,
        arguments=call.arguments,
        refused=refused,
    )


def check_fail_on(fail_on: object, where: str) -> tuple[type[BaseException], ...]:
    """An adapter's `fail_on`, checked to be a tuple of exception classes."""
    if not (
        isinstance(fail_on, tuple)
        and all(isinstance(e, type) and issubclass(e, BaseException) for e in fail_on)
    ):
        raise SagaDefinitionError(
            f"{where}: fail_on must be a tuple of exception classes, got {fail_on!r}"
        )
    return fail_on


def run_failure(error: BaseException, fail_on: tuple[type[BaseException], ...]) -> BaseException:
    """What an agent run's `error` is raised as: a `PermanentError` caused by it when it
    is one of `fail_on` (the session's calls are then compensated), else `error` itself."""
    if not (fail_on and isinstance(error, fail_on)) or isinstance(error, PermanentError):
        return error
    failed = PermanentError(
        f"the agent run failed for good ({type(error).__name__}: {error}); the "
        "session's tool calls are compensated"
    )
    failed.__cause__ = error
    return failed


def check_policy(policy: object, tool: str, where: str) -> ToolPolicy:
    """The policy an adapter was given for `tool`, checked to be a `ToolPolicy`."""
    if not isinstance(policy, ToolPolicy):
        raise SagaDefinitionError(
            f"{where}: the policy of tool {tool!r} must be a ToolPolicy, got {policy!r}"
        )
    return policy


def _in_key_order(value: Any) -> Any:
    """`value` (JSON) with every object's keys sorted, so that a framework that shows the
    model a result as text shows a replay as it showed the first call."""
    if isinstance(value, dict):
        return {key: _in_key_order(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_in_key_order(item) for item in value]
    return value


def _active_session(tool: str) -> AsyncSession:
    session = active_session()
    if isinstance(session, AsyncSession):
        return session
    if session is None:
        where = "outside a session"
    else:
        where = f"inside a {type(session).__name__}, which cannot await it"
    raise OutsideSession(
        f"tool {tool!r} was called {where}: run the agent inside "
        "`async with aorch.session(run_id):` of an AsyncOrchestrator; nothing was called"
    )


def _json_arguments(tool: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments as JSON (models as objects); `TypeError` naming the first
    argument that is not."""
    converted: dict[str, Any] = {}
    for name, value in arguments.items():
        try:
            converted[name] = to_jsonable_python(value)
            check_json(converted[name], where=name)
        except (PydanticSerializationError, TypeError, ValueError) as exc:
            raise TypeError(
                f"tool {tool!r}: argument {name!r} is not JSON ({exc}); a durable tool's "
                "arguments are stored with its call, so give it JSON parameters (or "
                "pydantic models); nothing was called"
            ) from None
    return converted


async def _succeeded(session: AsyncSession, operation: str) -> bool:
    """Whether `operation` of the session holds a result (a later call replays it)."""
    for event in await session.history():
        if event.step != operation or event.kind != "action":
            continue
        if event.event in _SUCCEEDED_EVENTS or (
            event.event == "operation_resolved" and event.detail.get("outcome") == "succeeded"
        ):
            return True
    return False


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a policy's hook: awaited when async, in a thread (the context carried) when
    sync, so that a slow provider never blocks the event loop."""
    if is_async(fn):
        return await fn(*args)
    return await asyncio.to_thread(fn, *args)


async def _compensate(
    fn: Callable[..., Any] | None, ctx: StepContext, result: Any, arguments: dict[str, Any]
) -> None:
    """Call a compensation, unless there is none or the call did nothing."""
    if fn is None or NoEffect.of_result(result) is not None:
        return
    await _call(fn, ctx, result, arguments)
