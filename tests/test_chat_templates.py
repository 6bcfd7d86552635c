"""Chat templates from a checkpoint or a file are untrusted (issue 53): rendering stays within its
time and output budgets, and a template that cannot compile is an error naming its file."""

import time

import pytest
HOSTILE_TEMPLATES = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    "nested loops writing": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "ljust": "{{ ''.ljust(10**10) }}",
    "repeat": "{{ 'x' * 10**10 }}",
    "repeat a list": "{{ ([1] * 10**9) | length }}",
    "tojson indent": "{{ messages | tojson(indent=10**9) }}",
    "center filter": "{{ 'x' | center(10**10) }}",
    "format": "{{ '%*s' | format(10**10, 'x') }}",
    "percent": "{{ '%*s' % (10**10, 'x') }}",
    "replace": "{% set s = 'x' * 3000 %}{{ s.replace('', s).replace('', s) }}",
    "power": "{{ 9 ** (10 ** 9) }}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
                "{{ ns.s | length }}",
    "lipsum": "{{ lipsum(n=10**7) }}",
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_a_400_within_its_budgets(name):
    """Rendering runs a template's loops on the host: a template from a checkpoint or a file that
    loops without end, or builds text of any size, stops at its time or output budget (or is
    refused before it builds it) with a ValueError naming the messages (a 400), in bounded time
    and memory; before, these took minutes or gigabytes."""
    import resource

    from server.chat import ChatTemplate

    template = ChatTemplate(HOSTILE_TEMPLATES[name], origin="hostile.jinja", time_budget=0.5, output_budget=100_000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ValueError, match="^messages: ") as caught:
        template.render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 5, name
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000, name  # KiB: under 200 MB more
    assert "\n" not in str(caught.value)


def test_chat_template_budgets_are_settable_and_a_normal_render_is_within_them():
    from server.chat import OUTPUT_BUDGET, TIME_BUDGET, ChatTemplate

    assert TIME_BUDGET >= 0.5 and OUTPUT_BUDGET >= 1_000_000
    long = [{"role": "user", "content": "x" * 50_000}]
    assert len(ChatTemplate().render(long)) > 50_000
    with pytest.raises(ValueError, match="the rendered prompt of .* characters is over its budget of 1,000"):
        ChatTemplate(output_budget=1_000).render(long)
    # width filters and str methods of ordinary sizes still work
    ok = ChatTemplate("{{ 'ab' | center(6) }}|{{ 'x'.ljust(3) }}|{{ '%-4s' % 'y' }}|{{ messages | tojson(indent=2) }}")
    assert ok.render([{"role": "user", "content": "c"}]).startswith("  ab  |x  |y   |[")


def test_a_template_too_deeply_nested_to_compile_names_its_file():
    from server.chat import ChatTemplate

    source = "{% if true %}" * 5000 + "x" + "{% endif %}" * 5000
    with pytest.raises(ValueError, match=r"^deep\.jinja: .*too deeply nested"):
        ChatTemplate(source, origin="deep.jinja")
