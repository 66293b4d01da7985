"""OpenAI Agents SDK agents whose tool calls are operations of a session (saga.integrations).

Real `Agent` objects run by the SDK's `Runner`, driven offline by a scripted `Model` (it
asks for tool calls, with a fresh `call_id` on every run, and reads what they returned),
against this test's fresh PostgreSQL; tracing is off and no OpenAI key is needed. The
providers are lists here, and a table of the test database for the child processes that
are killed mid-call (openai_agents_app.py), so every effect is counted where it happened.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from agents import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    Model,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    Tool,
    TResponseInputItem,
    Usage,
    set_tracing_disabled,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from saga import (
    AsyncOrchestrator,
    IdempotencyConflict,
    PermanentError,
    SagaDefinitionError,
    SagaStatus,
    StepContext,
    approvals,
    current_context,
)
from saga.durable import isolated_steps
from saga.integrations.openai_agents import (
    AgentRunInterrupted,
    ApprovalNeeded,
    ApprovalRequest,
    DurableTools,
    OutsideSession,
    sign_approval,
)

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).resolve().parent / "openai_agents_app.py"
EXAMPLE = ROOT / "examples" / "openai_agents_agent.py"
KEY = b"the approvers' secret"

set_tracing_disabled(True)


@pytest.fixture(autouse=True)
def _own_steps() -> Iterator[None]:
    """Each test's agents register their durable steps afresh."""
    with isolated_steps():
        yield


# ----- a scripted model ------------------------------------------------------------------------


@dataclass
class Script(Model):
    """Plays the model: `turns` are the tool calls it asks for, one list per turn (each call
    with a fresh call_id); once they are done it answers with the last tool output it was
    sent. A new run starts the script again from its first turn, as a model asked again
    does. `fail_after_tools` raises instead of answering (the model service going away
    after the tools ran). Every tool output the model was sent is kept, in order."""

    turns: list[list[tuple[str, dict[str, Any]]]]
    fail_after_tools: BaseException | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)  # function_call_output items
    asked: list[ResponseFunctionToolCall] = field(default_factory=list)

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: Any,
        handoffs: list[Any],
        tracing: ModelTracing,
        **kwargs: Any,
    ) -> ModelResponse:
        items = [dict(i) for i in input] if isinstance(input, list) else []
        known = {s["call_id"] for s in self.seen}
        self.seen.extend(
            i
            for i in items
            if i.get("type") == "function_call_output" and i["call_id"] not in known
        )
        made = sum(1 for i in items if i.get("type") == "function_call")
        turn, asked = 0, 0
        while turn < len(self.turns) and asked + len(self.turns[turn]) <= made:
            asked += len(self.turns[turn])
            turn += 1
        if turn < len(self.turns):
            calls = [call(name, arguments) for name, arguments in self.turns[turn]]
            self.asked.extend(calls)
            return ModelResponse(output=list(calls), usage=Usage(), response_id=None)
        if self.fail_after_tools is not None:
            raise self.fail_after_tools
        outputs = [i["output"] for i in items if i.get("type") == "function_call_output"]
        return ModelResponse(
            output=[message(outputs[-1] if outputs else "")], usage=Usage(), response_id=None
        )

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model does not stream")


def call(name: str, arguments: dict[str, Any]) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        type="function_call",
        name=name,
        arguments=json.dumps(arguments),
        call_id=f"call_{uuid.uuid4().hex[:12]}",
        id=f"fc_{uuid.uuid4().hex[:12]}",
        status="completed",
    )


def message(text: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=f"msg_{uuid.uuid4().hex[:8]}",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
    )


def agent_with(script: Script, tools: list[FunctionTool], name: str = "support") -> Agent[Any]:
    return Agent(name=name, model=script, tools=list(tools))


def run_id() -> str:
    return f"ticket-{uuid.uuid4().hex[:8]}"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@dataclass
class Provider:
    """A payment provider that dedupes on the idempotency key, and logs every call."""

    refunds: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def refund(self, order_id: str, amount_cents: int) -> dict[str, Any]:
        ctx = current_context()
        assert ctx is not None, "a durable tool runs inside its session's call"
        self.calls.append(f"refund {order_id} {amount_cents}")
        return self.refunds.setdefault(
            ctx.idempotency_key,
            {"refund_id": f"re_{uuid.uuid4().hex[:8]}", "amount_cents": amount_cents},
        )


def refund_tool(durable: DurableTools, provider: Provider, **policy: Any) -> FunctionTool:
    @durable.tool(key="{order_id}", volatile=("note",), **policy)
    def refund(order_id: str, amount_cents: int, note: str) -> dict[str, Any]:
        """Refund an order."""
        return provider.refund(order_id, amount_cents)

    return refund


def refund_call(amount_cents: int = 2400, order_id: str = "o-1") -> tuple[str, dict[str, Any]]:
    """A refund as the model asks for it: the note is new on every turn (volatile)."""
    note = f"asked at {uuid.uuid4().hex[:6]}"
    return "refund", {"order_id": order_id, "amount_cents": amount_cents, "note": note}


# ----- (1) retried and resumed runs replay ------------------------------------------------------


def test_a_retried_agent_run_replays_the_tool_call_and_the_model_sees_the_stored_result(
    database_url: str,
) -> None:
    provider = Provider()
    first = Script([[refund_call()]], fail_after_tools=ConnectionError("the model went away"))
    second = Script([[refund_call()]])
    ticket = run_id()

    async def main() -> tuple[int, int]:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support")
            agent = agent_with(first, [refund_tool(durable, provider, idempotent=True)])
            with pytest.raises(ConnectionError):
                async with aorch.session(ticket):
                    await durable.run(agent, "Refund order o-1.")
            # The run failed after the tool: the session stays open. A new run (a new
            # model turn, a new call_id, another note) asks for the same refund.
            agent.model = second
            async with aorch.session(ticket) as session:
                result = await durable.run(agent, "Refund order o-1.")
            assert result.final_output == first.seen[0]["output"]
            state = await aorch.get(session.id)
            assert state.status == SagaStatus.COMPLETED
            assert [op.status for op in state.operations] == ["succeeded"]
            return session.executed, session.replayed

    assert run(main()) == (0, 1)
    assert provider.calls == ["refund o-1 2400"], "the refund happened once"
    assert first.asked[0].call_id != second.asked[0].call_id
    assert first.asked[0].arguments != second.asked[0].arguments, "the notes differ (volatile)"
    # The model of the second run saw the result the first run stored.
    refund = next(iter(provider.refunds.values()))
    assert second.seen[0]["output"] == first.seen[0]["output"]
    assert refund["refund_id"] in second.seen[0]["output"]


def test_a_second_call_in_the_same_run_replays_and_a_changed_amount_is_a_conflict(
    database_url: str,
) -> None:
    provider = Provider()
    script = Script([[refund_call()], [refund_call()], [refund_call(amount_cents=9900)]])

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support")
            agent = agent_with(script, [refund_tool(durable, provider, idempotent=True)])
            with pytest.raises(IdempotencyConflict, match="other arguments"):
                async with aorch.session(run_id()):
                    await durable.run(agent, "Refund order o-1.")

    run(main())
    assert provider.calls == ["refund o-1 2400"], "replayed once, the changed amount refused"
    assert script.seen[0]["output"] == script.seen[1]["output"]


def test_invalid_arguments_are_answered_to_the_model_and_use_no_key(database_url: str) -> None:
    """Arguments that do not fit the function are refused before the call is recorded: the
    model is told, and its corrected call under the same key runs."""
    provider = Provider()
    script = Script(
        [
            [("refund", {"order_id": "o-1", "amount_cents": "lots", "note": "n"})],
            [refund_call()],
        ]
    )

    async def main() -> tuple[int, list[str]]:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support")
            agent = agent_with(script, [refund_tool(durable, provider)])
            async with aorch.session(run_id()) as session:
                await durable.run(agent, "Refund order o-1.")
            state = await aorch.get(session.id)
            return session.executed, [op.step for op in state.operations]

    executed, operations = run(main())
    assert executed == 1 and len(operations) == 1
    assert "Invalid JSON input for tool refund" in script.seen[0]["output"]
    assert provider.calls == ["refund o-1 2400"]


def test_a_tool_called_outside_a_session_is_refused_before_it_runs(database_url: str) -> None:
    provider = Provider()
    durable = DurableTools("support")
    agent = agent_with(Script([[refund_call()]]), [refund_tool(durable, provider)])
    with pytest.raises(OutsideSession, match=r"async with aorch\.session"):
        run(durable.run(agent, "Refund order o-1."))
    assert provider.calls == []


def test_tools_are_made_durable_only_in_ways_that_keep_their_errors(database_url: str) -> None:
    """A FunctionTool's default turns errors into messages, and its timeout cancels from
    outside: both are refused, with what to do instead."""
    from agents import function_tool

    durable = DurableTools("support")

    def lookup(order_id: str) -> str:
        return order_id

    with pytest.raises(SagaDefinitionError, match="in place of @function_tool"):
        durable.tool(key="{order_id}")(function_tool(lookup))
    with pytest.raises(SagaDefinitionError, match="failure_error_function"):
        durable.tool(failure_error_function=lambda ctx, exc: "oops")(lookup)
    with pytest.raises(SagaDefinitionError, match="timeout_seconds"):
        durable.tool(timeout=5.0)(lookup)
    made = function_tool(lookup, failure_error_function=None)
    with pytest.raises(SagaDefinitionError, match="policy of tool 'lookup' must be a ToolPolicy"):
        durable.wrap(made, {"key": "{order_id}"})  # type: ignore[arg-type]
    tool = durable.tool(key="{order_id}")(lookup)
    with pytest.raises(SagaDefinitionError, match="a tool named 'lookup' already"):
        durable.wrap(tool)


# ----- (2) a process killed during a tool call --------------------------------------------------


@pytest.fixture
def refunds_table(database_url: str) -> str:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE oai_refunds (refund_id text PRIMARY KEY, idempotency_key text NOT NULL,"
            " order_id text NOT NULL, amount_cents int NOT NULL)"
        )
    return database_url


def _child(url: str, ticket: str, tool: str, kill: str = "") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OAI_APP_URL": url,
        "OAI_APP_TOOL": tool,
        "OAI_APP_KILL": kill,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    return subprocess.run(
        [sys.executable, str(APP), ticket],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _lines(proc: subprocess.CompletedProcess[str], prefix: str) -> list[str]:
    start = f"OAI_APP {prefix}"
    return [
        line[len(start) :].strip() for line in proc.stdout.splitlines() if line.startswith(start)
    ]


def _outcome(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """What the child's session did: its last line, `{"output", "executed", "replayed",
    "reconciled"}`."""
    (line,) = [line for line in _lines(proc, "") if line.startswith("{")]
    outcome: dict[str, Any] = json.loads(line)
    return outcome


def _refunds(url: str) -> list[tuple[str, str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT refund_id, idempotency_key FROM oai_refunds").fetchall()
    return [(str(r[0]), str(r[1])) for r in rows]


@pytest.mark.crash
@pytest.mark.parametrize(
    ("tool", "kill", "settled_by"),
    [
        ("refund_reconciled", "after_effect", "RECONCILED found"),
        ("refund_reconciled", "before_effect", "RECONCILED absent"),
        ("refund_idempotent", "after_effect", None),
    ],
)
def test_a_run_killed_during_a_tool_call_resumes_with_the_effect_once(
    refunds_table: str, tool: str, kill: str, settled_by: str | None
) -> None:
    url, ticket = refunds_table, run_id()
    killed = _child(url, ticket, tool, kill=kill)
    shown = f"{killed.stdout}\n{killed.stderr}"
    assert killed.returncode == -signal.SIGKILL, shown
    assert _lines(killed, "KILLED") == [kill], shown
    assert len(_refunds(url)) == (1 if kill == "after_effect" else 0)

    resumed = _child(url, ticket, tool)
    shown = f"{resumed.stdout}\n{resumed.stderr}"
    assert resumed.returncode == 0, shown
    refunds = _refunds(url)
    assert len(refunds) == 1, f"the refund happened once: {refunds}\n{shown}"
    if settled_by is not None:
        assert _lines(resumed, "RECONCILED") == [settled_by.split()[1]], shown
    (seen,) = [json.loads(line) for line in _lines(resumed, "RESULT")]
    assert refunds[0][0] in seen["output"], "the model saw the one refund"
    assert _outcome(resumed)["output"] == "refunded"
    # A call its reconcile hook found was neither run again nor replayed.
    counts = {k: _outcome(resumed)[k] for k in ("executed", "replayed", "reconciled")}
    found = settled_by == "RECONCILED found"
    assert counts == {"executed": 0 if found else 1, "replayed": 0, "reconciled": int(found)}

    again = _child(url, ticket, tool)
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(_refunds(url)) == 1
    (seen_again,) = [json.loads(line) for line in _lines(again, "RESULT")]
    assert seen_again["output"] == seen["output"]
    assert seen_again["call_id"] != seen["call_id"], "a new call_id, the same stored result"
    assert _outcome(again)["replayed"] == 1


# ----- (3) confirmation: an approval bound to the call's request hash ---------------------------


def _waiting(exc: pytest.ExceptionInfo[AgentRunInterrupted]) -> tuple[str, ApprovalRequest]:
    ((call_id, request),) = exc.value.approval_requests().items()
    return call_id, request


def test_a_confirmed_tool_waits_for_an_approval_of_its_own_request(database_url: str) -> None:
    provider = Provider()
    script = Script([[refund_call(amount_cents=25_000)]])
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support", approval_key=KEY)
            refund = refund_tool(
                durable, provider, idempotent=True, confirm=lambda a: a["amount_cents"] > 10_000
            )
            agent = agent_with(script, [refund])

            async def attempt(resume: Any = None, tokens: dict[str, str] | None = None) -> str:
                async with aorch.session(ticket):
                    if resume is None:
                        result = await durable.run(agent, "Refund order o-1.")
                    else:
                        result = await durable.run(agent, resume, approvals=tokens)
                    return str(result.final_output)

            with pytest.raises(AgentRunInterrupted) as first:
                await attempt()
            call_id, request = _waiting(first)
            interrupted = first.value
            assert [i.raw_item.call_id for i in interrupted.interruptions] == [call_id]
            session = await aorch.get(request.saga_id)
            assert session.key == ticket and session.status == SagaStatus.RUNNING, "still open"
            assert request.tool == "refund" and request.key == "refund:o-1"
            assert request.arguments == {"order_id": "o-1", "amount_cents": 25_000}
            assert request.refused is None

            # A token signed with another key (forged) releases nothing.
            forged = sign_approval(
                b"not the approvers' key", request, actor="mallory", ttl_seconds=60
            )
            with pytest.raises(AgentRunInterrupted) as refused:
                await attempt(interrupted.state(), {call_id: forged})
            assert "signature does not match" in str(_waiting(refused)[1].refused)
            # A genuine token for another request releases nothing.
            elsewhere = approvals.sign(
                KEY,
                saga_id=request.saga_id,
                step=request.step,
                request_hash="0" * 64,
                actor="ana",
                ttl_seconds=60,
            )
            with pytest.raises(AgentRunInterrupted) as refused:
                await attempt(interrupted.state(), {call_id: elsewhere})
            assert "request_hash" in str(_waiting(refused)[1].refused)
            # An expired one neither; nor a token for a call that does not wait.
            stale = sign_approval(KEY, request, actor="ana", ttl_seconds=1, now=0)
            with pytest.raises(AgentRunInterrupted) as refused:
                await attempt(interrupted.state(), {call_id: stale})
            assert "expired" in str(_waiting(refused)[1].refused)
            with pytest.raises(ValueError, match="no tool call of this RunState waits"):
                await attempt(interrupted.state(), {"call_nobody": stale})
            # The SDK's own approval, a boolean, releases nothing: the call is not made. (Some
            # SDK versions share approvals between the states of one result: this goes last.)
            boolean = interrupted.state()
            boolean.approve(boolean.get_interruptions()[0])
            with pytest.raises(ApprovalNeeded) as needed:
                await attempt(boolean)
            assert needed.value.request.request_hash == request.request_hash
            assert provider.calls == []

            # The approval of exactly this request releases it, once.
            token = sign_approval(KEY, request, actor="ana", ttl_seconds=600)
            output = await attempt(interrupted.state(), {call_id: token})
            assert next(iter(provider.refunds.values()))["refund_id"] in output
            # The same approval again: the call replays, nothing runs.
            again = await attempt(interrupted.state(), {call_id: token})
            assert again == output
            # A new run asking for the same refund (new call_id) replays without asking.
            agent.model = Script([[refund_call(amount_cents=25_000)]])
            assert await attempt() == output

    run(main())
    assert provider.calls == ["refund o-1 25000"]


def test_changed_arguments_need_a_new_approval(database_url: str) -> None:
    provider = Provider()
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support", approval_key=KEY)
            refund = refund_tool(durable, provider, confirm=lambda a: a["amount_cents"] > 10_000)
            agent = agent_with(Script([[refund_call(amount_cents=25_000)]]), [refund])

            async def attempt(resume: Any = None, tokens: dict[str, str] | None = None) -> str:
                async with aorch.session(ticket):
                    if resume is None:
                        result = await durable.run(agent, "Refund order o-1.")
                    else:
                        result = await durable.run(agent, resume, approvals=tokens)
                    return str(result.final_output)

            with pytest.raises(AgentRunInterrupted) as first:
                await attempt()
            _, request = _waiting(first)
            token = sign_approval(KEY, request, actor="ana", ttl_seconds=600)

            # The model asks again, for 30000 under the same key: another request.
            agent.model = Script([[refund_call(amount_cents=30_000)]])
            with pytest.raises(AgentRunInterrupted) as changed:
                await attempt()
            changed_id, changed_request = _waiting(changed)
            assert changed_request.key == request.key
            assert changed_request.request_hash != request.request_hash
            # Approved for 25000, asked for 30000: refused.
            with pytest.raises(AgentRunInterrupted) as refused:
                await attempt(changed.value.state(), {changed_id: token})
            assert "request_hash" in str(_waiting(refused)[1].refused)
            assert provider.calls == []
            # A new approval, of the new request, releases it.
            new_token = sign_approval(KEY, changed_request, actor="ana", ttl_seconds=600)
            await attempt(changed.value.state(), {changed_id: new_token})

    run(main())
    assert provider.calls == ["refund o-1 30000"]


def test_with_the_approvers_public_key_only_their_signature_releases_a_call(
    database_url: str,
) -> None:
    """The agent's process holds the public key only: an HMAC token, or one signed by
    another key, is refused; the approvers' Ed25519 signature releases the call once."""
    from saga.approvals import ApprovalSigner

    approvers, intruder = ApprovalSigner.generate(), ApprovalSigner.generate()
    provider = Provider()
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support", approval_key=approvers.verifier())
            refund = refund_tool(durable, provider, confirm=True)
            agent = agent_with(Script([[refund_call(amount_cents=25_000)]]), [refund])

            async def attempt(token: str | None = None) -> str:
                async with aorch.session(ticket):
                    if token is None:
                        result = await durable.run(agent, "Refund order o-1.")
                    else:
                        result = await durable.run(agent, state(), approvals={call_id: token})
                    return str(result.final_output)

            with pytest.raises(AgentRunInterrupted) as first:
                await attempt()
            call_id, request = _waiting(first)
            state = first.value.state
            for forged in (
                sign_approval(KEY, request, actor="agent", ttl_seconds=600),
                sign_approval(intruder, request, actor="agent", ttl_seconds=600),
            ):
                with pytest.raises(AgentRunInterrupted) as refused:
                    await attempt(forged)
                assert _waiting(refused)[1].refused
            with pytest.raises(SagaDefinitionError, match="cannot sign"):
                sign_approval(approvers.verifier(), request, actor="ana", ttl_seconds=600)
            assert provider.calls == []
            await attempt(sign_approval(approvers, request, actor="ana", ttl_seconds=600))

    run(main())
    assert provider.calls == ["refund o-1 25000"]


def test_needs_approval_tools_take_a_bound_token_too(database_url: str) -> None:
    """The SDK's `needs_approval=True` would run on a boolean: here it needs the token."""
    sent: list[str] = []
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support", approval_key=KEY)

            @durable.tool(key="{iban}", needs_approval=True)
            def wire(iban: str, amount_cents: int) -> str:
                """Wire money."""
                sent.append(iban)
                return "sent"

            agent = agent_with(Script([[("wire", {"iban": "DE02", "amount_cents": 100})]]), [wire])
            with pytest.raises(AgentRunInterrupted) as first:
                async with aorch.session(ticket):
                    await durable.run(agent, "Wire it.")
            call_id, request = _waiting(first)
            state = first.value.state()
            state.approve(state.get_interruptions()[0])
            with pytest.raises(ApprovalNeeded):
                async with aorch.session(ticket):
                    await durable.run(agent, state)
            assert sent == []
            token = sign_approval(KEY, request, actor="ana", ttl_seconds=600)
            async with aorch.session(ticket):
                await durable.run(agent, first.value.state(), approvals={call_id: token})

    run(main())
    assert sent == ["DE02"]


# ----- (4) a permanent failure compensates in reverse ----------------------------------------


@dataclass
class Booking:
    """Reserve, charge, ship: the first two undone in reverse when the ticket fails."""

    log: list[str] = field(default_factory=list)
    ship_fails: bool = True

    def tools(self, durable: DurableTools) -> list[FunctionTool]:
        def release(ctx: StepContext, result: Any, arguments: dict[str, Any]) -> None:
            self.log.append(f"release {result['reservation']}")

        async def refund(ctx: StepContext, result: Any, arguments: dict[str, Any]) -> None:
            self.log.append(f"refund {result['charge']} of {arguments['amount_cents']}")

        @durable.tool(key="{sku}", compensate=release)
        def reserve(sku: str) -> dict[str, Any]:
            """Reserve stock."""
            self.log.append(f"reserve {sku}")
            return {"reservation": f"rs-{sku}"}

        @durable.tool(key="{order_id}", compensate=refund)
        async def charge(order_id: str, amount_cents: int) -> dict[str, Any]:
            """Charge the card."""
            self.log.append(f"charge {order_id}")
            return {"charge": f"ch-{order_id}"}

        @durable.tool(key="{order_id}")
        def ship(order_id: str) -> str:
            """Ship the order."""
            if self.ship_fails:
                raise PermanentError("the carrier refuses the address for good")
            self.log.append(f"ship {order_id}")
            return "shipped"

        return [reserve, charge, ship]


def booking_script(*, ship: bool = True, fail_after_tools: BaseException | None = None) -> Script:
    turns: list[list[tuple[str, dict[str, Any]]]] = [
        [("reserve", {"sku": "mug"})],
        [("charge", {"order_id": "o-1", "amount_cents": 2600})],
    ]
    if ship:
        turns.append([("ship", {"order_id": "o-1"})])
    return Script(turns, fail_after_tools=fail_after_tools)


def test_a_permanent_failure_compensates_the_completed_tool_calls_in_reverse(
    database_url: str,
) -> None:
    booking = Booking()

    async def main() -> SagaStatus:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support")
            agent = agent_with(booking_script(), booking.tools(durable))
            session = aorch.session(run_id())
            with pytest.raises(PermanentError, match="refuses the address"):
                async with session:
                    await durable.run(agent, "Book it.")
            return (await aorch.get(session.id)).status

    assert run(main()) == SagaStatus.COMPENSATED
    assert booking.log == [
        "reserve mug",
        "charge o-1",
        "refund ch-o-1 of 2600",
        "release rs-mug",
    ]


def test_a_failed_call_keeps_its_siblings_of_the_same_turn_from_starting(
    database_url: str,
) -> None:
    """The SDK runs the calls of one turn as concurrent tasks: after the first fails for
    good, the next is not started (it would be cut off mid-effect by the SDK)."""
    booking = Booking()
    script = Script(
        [
            [("reserve", {"sku": "mug"})],
            [("ship", {"order_id": "o-1"}), ("charge", {"order_id": "o-1", "amount_cents": 2600})],
        ]
    )

    async def main() -> list[str]:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support")
            agent = agent_with(script, booking.tools(durable))
            session = aorch.session(run_id())
            with pytest.raises(PermanentError, match="refuses the address"):
                async with session:
                    await durable.run(agent, "Book it.")
            state = await aorch.get(session.id)
            assert state.status == SagaStatus.COMPENSATED
            return [op.status.value for op in state.operations if op.kind == "action"]

    assert run(main()) == ["succeeded", "failed"], "charge was never recorded"
    assert booking.log == ["reserve mug", "release rs-mug"]


def test_run_errors_in_fail_on_compensate_and_others_leave_the_session_open(
    database_url: str,
) -> None:
    booking = Booking()
    ticket = run_id()

    async def main() -> tuple[SagaStatus, SagaStatus]:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support", fail_on=(MaxTurnsExceeded,))
            agent = agent_with(booking_script(ship=False), booking.tools(durable))
            other = DurableTools("other", fail_on=(MaxTurnsExceeded,))
            slow = agent_with(
                booking_script(ship=False, fail_after_tools=TimeoutError("slow")),
                booking.tools(other),
                name="other",
            )
            open_session = aorch.session(f"{ticket}-open")
            with pytest.raises(TimeoutError):
                async with open_session:
                    await other.run(slow, "Book it.")
            failed = aorch.session(ticket)
            with pytest.raises(PermanentError, match="MaxTurnsExceeded") as raised:
                async with failed:
                    await durable.run(agent, "Book it.", max_turns=2)
            assert isinstance(raised.value.__cause__, MaxTurnsExceeded)
            return (
                (await aorch.get(open_session.id)).status,
                (await aorch.get(failed.id)).status,
            )

    assert run(main()) == (SagaStatus.RUNNING, SagaStatus.COMPENSATED)
    assert booking.log == [
        "reserve mug",
        "charge o-1",
        "reserve mug",
        "charge o-1",
        "refund ch-o-1 of 2600",
        "release rs-mug",
    ]


def test_a_later_entry_compensates_calls_its_run_did_not_make_again(database_url: str) -> None:
    """The compensation of a call made by an earlier entry (another process, after a
    crash) is found by its tool's name, though the new run never makes it."""
    booking = Booking()
    ticket = run_id()

    async def main() -> SagaStatus:
        async with AsyncOrchestrator(database_url) as aorch:
            durable = DurableTools("support")
            agent = agent_with(
                booking_script(ship=False, fail_after_tools=ConnectionError()),
                booking.tools(durable),
            )
            with pytest.raises(ConnectionError):
                async with aorch.session(ticket):
                    await durable.run(agent, "Book it.")
            # The next entry's run goes straight to shipping, which fails for good.
            agent.model = Script([[("ship", {"order_id": "o-1"})]])
            session = aorch.session(ticket)
            with pytest.raises(PermanentError):
                async with session:
                    await durable.run(agent, "Ship it.")
            return (await aorch.get(session.id)).status

    assert run(main()) == SagaStatus.COMPENSATED
    assert booking.log[-2:] == ["refund ch-o-1 of 2600", "release rs-mug"]


# ----- the example -------------------------------------------------------------------------------


def test_the_example_runs_offline_and_each_effect_happens_once(database_url: str) -> None:
    def example(*flags: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "OPENAI_API_KEY": ""}
        return subprocess.run(
            [sys.executable, str(EXAMPLE), "--database-url", database_url, *flags],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    first = example("--ticket", "T-1")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "no effect happened twice" in first.stdout
    again = example("--ticket", "T-1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "executed 0, replayed 3" in again.stdout
    failing = example("--ticket", "T-2", "--fail-permanently")
    assert failing.returncode == 3, failing.stdout + failing.stderr
    assert "compensated" in failing.stdout
    # The charge ran (and was refunded): the counts say so, not zeros.
    assert "calls executed 1, replayed 0, reconciled 0" in failing.stdout, failing.stdout
