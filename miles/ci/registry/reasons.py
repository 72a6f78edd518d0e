"""Whether a `disabled=` reason says enough for someone to act on it.

A switched-off test keeps its reason in the registration; "Disable due to failure" loses the
diagnosis and nothing brings the test back. `disabled_reason_problem()` reads a reason for its
content, never its length, and says what is missing.
"""

from __future__ import annotations

import re

# A disabled= reason is read for its content: a tracking reference, a named subject (a
# component, kernel, model, error, hardware) together with a concrete symptom or cause, or one
# of the states a switched-off test is in (deprecated, superseded, pending, a named defect).
_TRACKING_REF = re.compile(r"(?:\b[\w.-]+/[\w.-]+)?#\d+\b|https?://\S+|\b[A-Z][A-Z0-9]+-\d+\b")
_TOKEN = re.compile(r"[A-Za-z0-9][\w.+/:-]*[A-Za-z0-9]|[A-Za-z0-9]")
_GENERIC_ACRONYMS = frozenset("PR CI TODO FIXME WIP TBD NA XXX OK AI HACK NOTE".split())
_DOMAIN_WORDS = frozenset(
    """nccl rccl cuda rocm hip sglang megatron fsdp ddp torch pytorch triton aiter mori deepep
    flashinfer transformers ray gloo numba vllm kernel kernels driver drivers firmware image
    container docker checkpoint checkpoints tokenizer rollout rollouts reward rewards optimizer
    allreduce all-to-all moe expert experts attention model models weights weight gradient
    gradients logprob logprobs loss lora quantization quantizer fp8 bf16 fp16 dataset server port
    memory disk network gpu gpus cpu node nodes rank ranks host hosts compiler wheel dependency
    upstream api endpoint download hub proxy dns clock timer seed scheduler dataloader router
    client semaphore infra infrastructure blackwell hopper ampere lovelace cdna rdna instinct""".split()
)
_SYMPTOM = re.compile(
    r"\b(?:[A-Za-z]*Error[A-Za-z]*|[A-Za-z]+Exception|error\s*(?:code\s*)?\d+|errno|exit(?:s|ed)?\s+(?:code\s+)?\d+"
    r"|HTTP\s*\d{3}|segfaults?|segmentation fault|SIG[A-Z]+|core dump(?:ed|s)?|crash(?:es|ed|ing)?"
    r"|hang(?:s|ing)?|hung|deadlocks?|stall(?:s|ed)?|times? out|timed out|timeouts?|OOMs?|out of memory"
    r"|NaNs?|inf(?:inite)?|diverg\w*|mismatch\w*|differ(?:s|ent)?|drift\w*|drops?|aborts?|aborted"
    r"|assert(?:ion)?s?|illegal (?:memory|instruction)|leaks?|wrong|incorrect|miscompil\w*|regress\w*"
    r"|corrupt\w*|lose|loses|lost|exceeds?|exceeding|over (?:the )?[\w ]*budget|takes \d+|slower|too slow"
    r"|fails? to \w+|failed to \w+|cannot \w+|can't \w+|unable to \w+|not divisible|not supported|unsupported"
    r"|not (?:yet )?(?:implemented|available|ported|installed|released)|deprecated|removed|no longer"
    r"|missing|requires?|needs?|depends on|waiting (?:for|on)|blocked (?:by|on)|until|rate.limited"
    r"|no (?:module|wheel|kernel|support|space)|refused|unreachable)\b",
    re.IGNORECASE,
)
# Words that never name what a reason is about on their own ("this test is deprecated").
_GENERIC_WORDS = frozenset(
    """a an the this that these those it its they them some any another other new old same our
    we one test tests testing case cases file files suite suites job jobs run runs thing things
    issue issues problem problems bug bugs failure failures fail fails failing review fix fixes
    later now soon time disable disabled temporarily because due flaky fixme todo known random
    weird unstable broken support code""".split()
)
_NOUN_PHRASE = r"(?:[\w.+/:-]+\s+){0,4}[\w.+/:-]+"
_CLAUSE = r"[^.;,]{1,200}"
# States a disabled test is in, each with the slot that must name its subject: "strict" takes
# the same names as a symptom does (identifiers, acronyms, domain nouns); "noun" any content word.
_STATES = (
    # "Miles Router is deprecated.", "the v1 dumper was removed"
    (
        re.compile(
            rf"(?P<what>{_NOUN_PHRASE})\s+(?:is|are|was|were|has been|have been)\s+(?:deprecated|removed|"
            r"obsolete|retired|discontinued|no longer (?:supported|maintained|used))\b",
            re.IGNORECASE,
        ),
        "noun",
    ),
    # "superseded by test_deepseek_v32_5layer_ci on H100"
    (
        re.compile(
            rf"\b(?:superseded|replaced|covered|obsoleted) by\s+(?P<what>{_CLAUSE})|"
            rf"\b(?:duplicate of|duplicates|moved to|merged into)\s+(?P<what2>{_CLAUSE})",
            re.IGNORECASE,
        ),
        "strict",
    ),
    # "FT soak tests pending CI infra support"
    (re.compile(rf"\bpending\s+(?P<what>{_CLAUSE})", re.IGNORECASE), "strict"),
    # a named defect: "sglang deepep code path bug", "bug in the mori dispatcher"
    (
        re.compile(
            rf"(?P<what>{_NOUN_PHRASE})\s+bugs?\b|\bbugs? (?:in|of)\s+(?P<what2>{_CLAUSE})", re.IGNORECASE
        ),
        "strict",
    ),
    # re-enabling waits on something named: "after the MXFP8 H200 reference path is settled",
    # "after the shared HTTP client is reset between cases" (never "once this case passes")
    (
        re.compile(
            rf"\b(?:after|once|when)\s+(?P<what>{_CLAUSE}?)\s+(?:is|are|gets?|get|has been|have been)\s+"
            r"(?:settled|fixed|resolved|merged|landed|released|reset|available|supported|ready|shipped|"
            r"restored|upgraded)\b",
            re.IGNORECASE,
        ),
        "strict",
    ),
)


def _subjects(reason: str) -> list[str]:
    """Words that name a specific thing: identifiers, versions, acronyms, domain nouns."""
    found = []
    for token in _TOKEN.findall(reason):
        core = token.strip(".:/-")
        if not core or core.upper() in _GENERIC_ACRONYMS:
            continue
        identifier = (
            re.search(r"[A-Za-z]", core)
            and re.search(r"\d", core)  # gfx950, H200, fp8, M2.7
            or re.search(r"[_/]|::|\w\.\w", core)  # world_size, a/b, torch.distributed
            or re.search(r"[a-z][A-Z]", core)  # MiniMax, hipErrorNoDevice
            or (core.isupper() and len(core) >= 2)  # NCCL, HIP, OOM
        )
        if identifier or core.lower() in _DOMAIN_WORDS:
            found.append(core)
    return found


def _names_something(text: str, slot: str) -> bool:
    if _subjects(text):
        return True
    if slot == "strict":
        return False
    words = (w.lower() for w in re.findall(r"[A-Za-z][A-Za-z0-9_-]{2,}", text))
    return any(w not in _GENERIC_WORDS for w in words)


def _states(reason: str) -> bool:
    """Whether the reason states what the test waits on or why it is switched off for good."""
    for pattern, slot in _STATES:
        for match in pattern.finditer(reason):
            what = match.group("what") or (match.groupdict().get("what2") or "")
            if _names_something(what, slot):
                return True
    return False


def disabled_reason_problem(reason: str) -> str | None:
    """Why `reason` is not an acceptable `disabled=` value, or None when it is.

    A reason is accepted when it cites a tracking reference (#123, owner/repo#123, a URL or
    a ticket like ROCM-123); or names what fails (a component, kernel, model, error or
    hardware: 'aiter fused-MoE kernel', 'MiniMax M2.7') and how or why (a symptom or cause:
    'aborts with HIP error 700', 'is deprecated', 'needs 8 GPUs'); or states, about something
    named, that it is deprecated or removed, superseded by another test, pending some
    infrastructure, a named defect ('sglang deepep code path bug'), or what re-enabling
    waits on ('after the MXFP8 H200 reference path is settled'). Words like "flaky",
    "broken", "random bugs" or "failure" say none of this.
    """
    if _TRACKING_REF.search(reason):
        return None
    subject, symptom = _subjects(reason), _SYMPTOM.search(reason)
    if (subject and symptom) or _states(reason):
        return None
    shown = reason if reason.strip() else "(empty)"
    missing = (
        "what fails (a component, kernel, model, error or hardware)"
        if not subject
        else "how or why it fails (the error, symptom or cause)"
    )
    return (
        f"disabled={shown!r} gives no diagnosis: it does not say {missing}; say what fails and why "
        "(e.g. 'aiter fused-MoE kernel aborts with HIP error 700 on gfx950'), what replaced it or "
        "what re-enabling waits on, or cite a tracking reference (#123 or a URL)"
    )
