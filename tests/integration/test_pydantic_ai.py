"""pydantic-ai agents whose tool calls are operations of a session (saga.integrations).

Real `Agent` objects, driven offline by pydantic-ai's `FunctionModel` (a script plays the
model: it asks for tool calls, with a fresh `tool_call_id` on every run, and reads what
they returned), against this test's fresh PostgreSQL. The providers are lists here, and
a table of the test database for the child processes that are killed mid-call
(pydantic_ai_app.py), so every effect is counted where it happened.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.tools import ToolApproved

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
from saga.integrations.pydantic_ai import (
    AgentRunDeferred,
    ApprovalRequest,
    DurableTools,
    OutsideSession,
    approval_results,
    sign_approval,
    tool_policy,
)

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).resolve().parent / "pydantic_ai_app.py"
EXAMPLE = ROOT / "examples" / "refund_agent_pydantic_ai.py"
KEY = b"the approvers' secret"


@pytest.fixture(autouse=True)
def _own_steps() -> Iterator[None]:
    """Each test's agents register their durable steps afresh."""
    with isolated_steps():
        yield


# ----- a scripted model ------------------------------------------------------------------------


@dataclass
class Script:
    """Plays the model: `turns` are the tool calls it asks for, one list per turn (each call
    with a fresh tool_call_id); once they are done it answers with the last tool result.
    `fail_after_tools` raises instead of answering (the model service going away after the
    tools ran). Everything the model was sent is kept."""

    turns: list[list[tuple[str, dict[str, Any]]]]
    fail_after_tools: BaseException | None = None
    seen: list[Any] = field(default_factory=list)  # ToolReturnPart and retry prompts
    asked: list[ToolCallPart] = field(default_factory=list)

    def model(self) -> FunctionModel:
        return FunctionModel(self.respond)

    def respond(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        latest = messages[-1]
        # Tool returns, and retry prompts (a part of their own in older pydantic-ai).
        self.seen.extend(p for p in latest.parts if getattr(p, "tool_call_id", None))
        done = sum(1 for m in messages if isinstance(m, ModelResponse) and _calls(m))
        if done < len(self.turns):
            calls = [
                ToolCallPart(name, arguments, tool_call_id=f"call_{uuid.uuid4().hex[:12]}")
                for name, arguments in self.turns[done]
            ]
            self.asked.extend(calls)
            return ModelResponse(parts=list(calls))
        if self.fail_after_tools is not None:
            raise self.fail_after_tools
        last = self.seen[-1].content if self.seen else None
        return ModelResponse(parts=[TextPart(json.dumps(last))])


def _calls(response: ModelResponse) -> list[ToolCallPart]:
    return [p for p in response.parts if isinstance(p, ToolCallPart)]


def agent_with(script: Script, *, name: str = "support", **durable: Any) -> Agent[None, Any]:
    return Agent(
        script.model(),
        name=name,
        output_type=[str, DeferredToolRequests],
        capabilities=[DurableTools(approval_key=KEY, **durable)],
    )


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


def refund_tool(
    agent: Agent[None, Any], provider: Provider, **policy: Any
) -> Callable[..., dict[str, Any]]:
    @agent.tool_plain(metadata=tool_policy(key="{order_id}", volatile=("note",), **policy))
    def refund(order_id: str, amount_cents: int, note: str = "") -> dict[str, Any]:
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
            agent = agent_with(first)
            refund_tool(agent, provider, idempotent=True)
            with pytest.raises(ConnectionError):
                async with aorch.session(ticket):
                    await agent.run("Refund order o-1.")
            # The run failed after the tool: the session stays open. A new run (a new
            # model turn, a new tool_call_id, another note) asks for the same refund.
            agent.model = second.model()
            async with aorch.session(ticket) as session:
                result = await agent.run("Refund order o-1.")
            assert json.loads(result.output) == first.seen[0].content
            state = await aorch.get(session.id)
            assert state.status == SagaStatus.COMPLETED
            assert [op.status for op in state.operations] == ["succeeded"]
            return session.executed, session.replayed

    assert run(main()) == (0, 1)
    assert provider.calls == ["refund o-1 2400"], "the refund happened once"
    assert first.asked[0].tool_call_id != second.asked[0].tool_call_id
    assert first.asked[0].args != second.asked[0].args, "the notes differ (volatile)"
    # The model of the second run saw the result the first run stored.
    assert second.seen[0].content == first.seen[0].content == next(iter(provider.refunds.values()))


def test_a_second_call_in_the_same_run_replays_and_a_changed_amount_is_a_conflict(
    database_url: str,
) -> None:
    provider = Provider()
    script = Script([[refund_call()], [refund_call()], [refund_call(amount_cents=9900)]])

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            agent = agent_with(script)
            refund_tool(agent, provider, idempotent=True)
            with pytest.raises(IdempotencyConflict, match="other arguments"):
                async with aorch.session(run_id()):
                    await agent.run("Refund order o-1.")

    run(main())
    assert provider.calls == ["refund o-1 2400"], "replayed once, the changed amount refused"
    assert script.seen[0].content == script.seen[1].content


def test_a_tool_answer_that_did_nothing_replays_as_the_same_answer(database_url: str) -> None:
    """A tool that raises ModelRetry did nothing: its answer is stored, and replayed."""
    lookups: list[str] = []
    scripts = [
        Script([[("lookup", {"order_id": "o-x"})], [("lookup", {"order_id": "o-1"})]])
        for _ in range(2)
    ]
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            agent = agent_with(scripts[0])

            @agent.tool_plain(metadata=tool_policy(key="{order_id}"))
            def lookup(order_id: str) -> dict[str, Any]:
                """Look an order up."""
                from pydantic_ai import ModelRetry

                lookups.append(order_id)
                if order_id != "o-1":
                    raise ModelRetry(f"there is no order {order_id}; ask the customer again")
                return {"order_id": order_id, "paid_cents": 2400}

            for script in scripts:
                agent.model = script.model()
                async with aorch.session(ticket):
                    await agent.run("Look up the order.")

    run(main())
    assert lookups == ["o-x", "o-1"], "each lookup ran once"
    first, again = ([(type(p).__name__, p.content) for p in s.seen] for s in scripts)
    assert first == again
    assert "there is no order o-x" in str(first[0][1])
    assert first[1] == ("ToolReturnPart", {"order_id": "o-1", "paid_cents": 2400})


def test_a_tool_called_outside_a_session_is_refused_before_it_runs(database_url: str) -> None:
    provider = Provider()
    agent = agent_with(Script([[refund_call()]]))
    refund_tool(agent, provider)
    with pytest.raises(OutsideSession, match=r"async with aorch\.session"):
        run(agent.run("Refund order o-1."))
    assert provider.calls == []


def test_a_policy_that_is_not_a_tool_policy_is_refused_naming_its_tool() -> None:
    with pytest.raises(SagaDefinitionError, match="policy of tool 'refund' must be a ToolPolicy"):
        DurableTools(name="support", policies={"refund": {"key": "{order_id}"}})  # type: ignore[dict-item]


# ----- (2) a process killed during a tool call --------------------------------------------------


@pytest.fixture
def refunds_table(database_url: str) -> str:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE pyai_refunds (refund_id text PRIMARY KEY, idempotency_key text NOT NULL,"
            " order_id text NOT NULL, amount_cents int NOT NULL)"
        )
    return database_url


def _child(url: str, ticket: str, tool: str, kill: str = "") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYAI_APP_URL": url,
        "PYAI_APP_TOOL": tool,
        "PYAI_APP_KILL": kill,
        "PYTHONPATH": str(ROOT),
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
    start = f"PYAI_APP {prefix}"
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
        rows = conn.execute("SELECT refund_id, idempotency_key FROM pyai_refunds").fetchall()
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
    assert seen["content"]["refund_id"] == refunds[0][0], "the model saw the one refund"
    assert _outcome(resumed)["output"] == "refunded"
    # A call its reconcile hook found was neither run again nor replayed.
    counts = {k: _outcome(resumed)[k] for k in ("executed", "replayed", "reconciled")}
    found = settled_by == "RECONCILED found"
    assert counts == {"executed": 0 if found else 1, "replayed": 0, "reconciled": int(found)}

    again = _child(url, ticket, tool)
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(_refunds(url)) == 1
    (seen_again,) = [json.loads(line) for line in _lines(again, "RESULT")]
    assert seen_again["content"] == seen["content"]
    assert _outcome(again)["replayed"] == 1


# ----- (3) confirmation: an approval bound to the call's request hash ---------------------------


def _deferred(exc: pytest.ExceptionInfo[AgentRunDeferred]) -> tuple[str, ApprovalRequest]:
    ((call_id, request),) = exc.value.approval_requests().items()
    return call_id, request


def test_a_confirmed_tool_waits_for_an_approval_of_its_own_request(database_url: str) -> None:
    provider = Provider()
    script = Script([[refund_call(amount_cents=25_000)]])
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            agent = agent_with(script)
            refund_tool(
                agent, provider, idempotent=True, confirm=lambda a: a["amount_cents"] > 10_000
            )

            async def attempt(**resume: Any) -> str:
                async with aorch.session(ticket):
                    return str((await agent.run("Refund order o-1.", **resume)).output)

            with pytest.raises(AgentRunDeferred) as first:
                await attempt()
            call_id, request = _deferred(first)
            history = first.value.messages
            session = await aorch.get(request.saga_id)
            assert session.key == ticket and session.status == SagaStatus.RUNNING, "still open"
            assert request.tool == "refund" and request.key == "refund:o-1"
            assert request.arguments == {"order_id": "o-1", "amount_cents": 25_000}
            assert request.refused is None
            assert session.operations == [], "nothing was called, nothing recorded"

            # pydantic-ai's own boolean approval releases nothing.
            with pytest.raises(AgentRunDeferred) as boolean:
                await attempt(
                    message_history=history,
                    deferred_tool_results=_approved(call_id, token=None),
                )
            assert _deferred(boolean)[1].refused is None
            # A token signed with another key (forged) releases nothing.
            forged = sign_approval(
                b"not the approvers' key", request, actor="mallory", ttl_seconds=60
            )
            with pytest.raises(AgentRunDeferred) as refused:
                await attempt(
                    message_history=history,
                    deferred_tool_results=approval_results({call_id: forged}),
                )
            assert "signature does not match" in str(_deferred(refused)[1].refused)
            # A genuine token for another request (another amount) releases nothing; and
            # sign_approval refuses to sign a request whose hash is not what it shows.
            shown = {**request.arguments, "amount_cents": 2_500}
            tampered = ApprovalRequest(**{**_fields(request), "arguments": shown})
            with pytest.raises(ValueError, match="not those of the key and arguments"):
                sign_approval(KEY, tampered, actor="ana", ttl_seconds=60)
            elsewhere = approvals.sign(
                KEY,
                saga_id=request.saga_id,
                step=request.step,
                request_hash="0" * 64,
                actor="ana",
                ttl_seconds=60,
            )
            with pytest.raises(AgentRunDeferred) as refused:
                await attempt(
                    message_history=history,
                    deferred_tool_results=approval_results({call_id: elsewhere}),
                )
            assert "request_hash" in str(_deferred(refused)[1].refused)
            # An expired one neither.
            stale = sign_approval(KEY, request, actor="ana", ttl_seconds=1, now=0)
            with pytest.raises(AgentRunDeferred) as refused:
                await attempt(
                    message_history=history,
                    deferred_tool_results=approval_results({call_id: stale}),
                )
            assert "expired" in str(_deferred(refused)[1].refused)
            assert provider.calls == []

            # The approval of exactly this request releases it, once.
            token = sign_approval(KEY, request, actor="ana", ttl_seconds=600)
            output = await attempt(
                message_history=history, deferred_tool_results=approval_results({call_id: token})
            )
            assert json.loads(output) == next(iter(provider.refunds.values()))
            # The same approval again: the call replays, nothing runs.
            again = await attempt(
                message_history=history, deferred_tool_results=approval_results({call_id: token})
            )
            assert again == output
            # A new run asking for the same refund (new tool_call_id) replays without asking.
            agent.model = Script([[refund_call(amount_cents=25_000)]]).model()
            assert await attempt() == output

    run(main())
    assert provider.calls == ["refund o-1 25000"]


def _approved(call_id: str, *, token: str | None) -> Any:
    from pydantic_ai import DeferredToolResults

    metadata = {} if token is None else {call_id: {"saga_approval": token}}
    return DeferredToolResults(approvals={call_id: True}, metadata=metadata)


def _fields(request: ApprovalRequest) -> dict[str, Any]:
    return {
        "saga_id": request.saga_id,
        "step": request.step,
        "request_hash": request.request_hash,
        "tool": request.tool,
        "key": request.key,
        "arguments": request.arguments,
    }


def test_changed_arguments_need_a_new_approval(database_url: str) -> None:
    provider = Provider()
    script = Script([[refund_call(amount_cents=25_000)]])
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            agent = agent_with(script)
            refund_tool(agent, provider, confirm=lambda a: a["amount_cents"] > 10_000)

            async def attempt(**resume: Any) -> str:
                async with aorch.session(ticket):
                    return str((await agent.run("Refund order o-1.", **resume)).output)

            with pytest.raises(AgentRunDeferred) as first:
                await attempt()
            call_id, request = _deferred(first)
            history = first.value.messages
            token = sign_approval(KEY, request, actor="ana", ttl_seconds=600)
            changed = {"order_id": "o-1", "amount_cents": 30_000, "note": "more"}

            def approve(token: str, args: dict[str, Any]) -> Any:
                from pydantic_ai import DeferredToolResults

                return DeferredToolResults(
                    approvals={call_id: ToolApproved(override_args=args)},
                    metadata={call_id: {"saga_approval": token}},
                )

            # Approved for 25000, run with 30000: another request hash, refused.
            with pytest.raises(AgentRunDeferred) as refused:
                await attempt(
                    message_history=history, deferred_tool_results=approve(token, changed)
                )
            _, changed_request = _deferred(refused)
            assert "request_hash" in str(changed_request.refused)
            assert changed_request.arguments["amount_cents"] == 30_000
            assert changed_request.request_hash != request.request_hash
            assert provider.calls == []
            # A new approval, of the new request, releases it.
            new_token = sign_approval(KEY, changed_request, actor="ana", ttl_seconds=600)
            await attempt(
                message_history=history, deferred_tool_results=approve(new_token, changed)
            )

    run(main())
    assert provider.calls == ["refund o-1 30000"]


def test_an_approved_flag_from_the_model_or_a_confirmation_row_written_by_hand_does_nothing(
    database_url: str,
) -> None:
    """The model sets `"approved": true` in the arguments, and a tool with database access
    writes an approved row into saga.confirmations for the call: neither releases it."""
    provider = Provider()
    script = Script([[("refund", {"order_id": "o-9", "amount_cents": 50_000, "approved": True})]])
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            agent = agent_with(script)

            @agent.tool_plain(
                metadata=tool_policy(key="{order_id}", volatile=("approved",), confirm=True)
            )
            def refund(order_id: str, amount_cents: int, approved: bool = False) -> dict[str, Any]:
                """Refund an order."""
                return provider.refund(order_id, amount_cents)

            async def attempt(**resume: Any) -> str:
                async with aorch.session(ticket):
                    return str((await agent.run("Refund order o-9.", **resume)).output)

            with pytest.raises(AgentRunDeferred) as first:
                await attempt()
            call_id, request = _deferred(first)
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO saga.confirmations (saga_id, step, request_hash, preview, "
                    "expires_at, approved_by, approved_at) VALUES (%s, %s, %s, '{}', "
                    "now() + interval '1 hour', 'the agent', now())",
                    (request.saga_id, request.step, request.request_hash),
                )
            with pytest.raises(AgentRunDeferred):
                await attempt(
                    message_history=first.value.messages,
                    deferred_tool_results=_approved(call_id, token=None),
                )

    run(main())
    assert provider.calls == []


def test_with_the_approvers_public_key_only_their_signature_releases_a_call(
    database_url: str,
) -> None:
    """The agent's process holds the public key only: an HMAC token, or one signed by
    another key, is refused; the approvers' Ed25519 signature releases the call once."""
    from saga.approvals import ApprovalSigner

    approvers, intruder = ApprovalSigner.generate(), ApprovalSigner.generate()
    provider = Provider()
    script = Script([[refund_call(amount_cents=25_000)]])
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            agent = Agent(
                script.model(),
                name="support",
                output_type=[str, DeferredToolRequests],
                capabilities=[DurableTools(approval_key=approvers.verifier())],
            )
            refund_tool(agent, provider, confirm=True)

            async def attempt(token: str | None = None) -> str:
                resume: dict[str, Any] = {}
                if token is not None:
                    resume = {
                        "message_history": history,
                        "deferred_tool_results": approval_results({call_id: token}),
                    }
                async with aorch.session(ticket):
                    return str((await agent.run("Refund order o-1.", **resume)).output)

            with pytest.raises(AgentRunDeferred) as first:
                await attempt()
            call_id, request = _deferred(first)
            history = first.value.messages
            for forged in (
                sign_approval(KEY, request, actor="agent", ttl_seconds=600),
                sign_approval(intruder, request, actor="agent", ttl_seconds=600),
            ):
                with pytest.raises(AgentRunDeferred) as refused:
                    await attempt(forged)
                assert _deferred(refused)[1].refused
            with pytest.raises(SagaDefinitionError, match="cannot sign"):
                sign_approval(approvers.verifier(), request, actor="ana", ttl_seconds=600)
            assert provider.calls == []
            await attempt(sign_approval(approvers, request, actor="ana", ttl_seconds=600))

    run(main())
    assert provider.calls == ["refund o-1 25000"]


def test_requires_approval_tools_take_a_bound_token_too(database_url: str) -> None:
    """pydantic-ai's `requires_approval=True` would run on a boolean: here it needs the token."""
    sent: list[str] = []
    script = Script([[("wire", {"iban": "DE02", "amount_cents": 100})]])
    ticket = run_id()

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            agent = agent_with(script)

            @agent.tool_plain(requires_approval=True, metadata=tool_policy(key="{iban}"))
            def wire(iban: str, amount_cents: int) -> str:
                """Wire money."""
                sent.append(iban)
                return "sent"

            async def attempt(**resume: Any) -> str:
                async with aorch.session(ticket):
                    return str((await agent.run("Wire it.", **resume)).output)

            with pytest.raises(AgentRunDeferred) as first:
                await attempt()
            call_id, request = _deferred(first)
            with pytest.raises(AgentRunDeferred):
                await attempt(
                    message_history=first.value.messages,
                    deferred_tool_results=_approved(call_id, token=None),
                )
            assert sent == []
            token = sign_approval(KEY, request, actor="ana", ttl_seconds=600)
            await attempt(
                message_history=first.value.messages,
                deferred_tool_results=approval_results({call_id: token}),
            )

    run(main())
    assert sent == ["DE02"]


# ----- (4) a permanent failure compensates in reverse ----------------------------------------


@dataclass
class Booking:
    """Reserve, charge, ship: the first two undone in reverse when the ticket fails."""

    log: list[str] = field(default_factory=list)
    ship_fails: bool = True

    def tools(self, agent: Agent[None, Any]) -> None:
        def release(ctx: StepContext, result: Any, arguments: dict[str, Any]) -> None:
            self.log.append(f"release {result['reservation']}")

        async def refund(ctx: StepContext, result: Any, arguments: dict[str, Any]) -> None:
            self.log.append(f"refund {result['charge']} of {arguments['amount_cents']}")

        @agent.tool_plain(metadata=tool_policy(key="{sku}", compensate=release))
        def reserve(sku: str) -> dict[str, Any]:
            """Reserve stock."""
            self.log.append(f"reserve {sku}")
            return {"reservation": f"rs-{sku}"}

        @agent.tool_plain(metadata=tool_policy(key="{order_id}", compensate=refund))
        async def charge(order_id: str, amount_cents: int) -> dict[str, Any]:
            """Charge the card."""
            self.log.append(f"charge {order_id}")
            return {"charge": f"ch-{order_id}"}

        @agent.tool_plain(metadata=tool_policy(key="{order_id}"))
        def ship(order_id: str) -> str:
            """Ship the order."""
            if self.ship_fails:
                raise PermanentError("the carrier refuses the address for good")
            self.log.append(f"ship {order_id}")
            return "shipped"


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
            agent = agent_with(booking_script())
            booking.tools(agent)
            session = aorch.session(run_id())
            with pytest.raises(PermanentError, match="refuses the address"):
                async with session:
                    await agent.run("Book it.")
            return (await aorch.get(session.id)).status

    assert run(main()) == SagaStatus.COMPENSATED
    assert booking.log == [
        "reserve mug",
        "charge o-1",
        "refund ch-o-1 of 2600",
        "release rs-mug",
    ]


def test_run_errors_in_fail_on_compensate_and_others_leave_the_session_open(
    database_url: str,
) -> None:
    booking = Booking()
    ticket = run_id()

    async def main() -> tuple[SagaStatus, SagaStatus]:
        async with AsyncOrchestrator(database_url) as aorch:
            gave_up = RuntimeError("the model gave up")
            agent = agent_with(
                booking_script(ship=False, fail_after_tools=gave_up), fail_on=(RuntimeError,)
            )
            booking.tools(agent)
            other = agent_with(
                booking_script(ship=False, fail_after_tools=TimeoutError("slow")), name="other"
            )
            booking.tools(other)
            open_session = aorch.session(f"{ticket}-open")
            with pytest.raises(TimeoutError):
                async with open_session:
                    await other.run("Book it.")
            failed = aorch.session(ticket)
            with pytest.raises(PermanentError, match="the model gave up") as raised:
                async with failed:
                    await agent.run("Book it.")
            assert raised.value.__cause__ is gave_up
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
    crash) is found through the agent's tools, though the new run never makes it."""
    booking = Booking()
    ticket = run_id()

    async def main() -> SagaStatus:
        async with AsyncOrchestrator(database_url) as aorch:
            agent = agent_with(booking_script(ship=False, fail_after_tools=ConnectionError()))
            booking.tools(agent)
            with pytest.raises(ConnectionError):
                async with aorch.session(ticket):
                    await agent.run("Book it.")
            # The next entry's run goes straight to shipping, which fails for good.
            agent.model = Script([[("ship", {"order_id": "o-1"})]]).model()
            session = aorch.session(ticket)
            with pytest.raises(PermanentError):
                async with session:
                    await agent.run("Ship it.")
            return (await aorch.get(session.id)).status

    assert run(main()) == SagaStatus.COMPENSATED
    assert booking.log[-2:] == ["refund ch-o-1 of 2600", "release rs-mug"]


# ----- the example -------------------------------------------------------------------------------


def test_the_example_runs_offline_and_each_effect_happens_once(database_url: str) -> None:
    def example(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(EXAMPLE), "--database-url", database_url, *flags],
            cwd=ROOT,
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
    failing = example("--ticket", "T-2", "--fail-permanently")
    assert failing.returncode == 3, failing.stdout + failing.stderr
    assert "compensated" in failing.stdout
    # The charge ran (and was refunded): the counts say so, not zeros.
    assert "calls executed 1, replayed 0, reconciled 0" in failing.stdout, failing.stdout
