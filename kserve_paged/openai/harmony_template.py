"""The Harmony chat template: OpenAI chat messages and tools rendered as gpt-oss reads them.

The released gpt-oss checkpoints ship their own template; this one is ours, written from
OpenAI's Harmony format description, for a gpt-oss checkpoint without one (the server falls
back to it, see `harmony_enabled`) and for the tests' tiny models. What it renders:

- a ``system`` message with the model identity, knowledge cutoff, date, ``Reasoning:`` (the
  ``reasoning_effort`` template kwarg, default medium) and the valid channels;
- a ``developer`` message with the request's system (or developer) prompt as ``# Instructions``
  and its tools as a TypeScript-like ``namespace functions``;
- user turns; assistant answers on the ``final`` channel; an assistant's tool calls as
  ``commentary to=functions.NAME <|constrain|>json`` messages ending in ``<|call|>``, after its
  reasoning (``reasoning``, ``reasoning_content`` or ``thinking``) on ``analysis`` when that
  turn is still running (reasoning of finished turns is dropped, as Harmony asks);
- tool results as ``functions.NAME to=assistant`` commentary messages;
- the generation prompt ``<|start|>assistant``.
"""

from __future__ import annotations

HARMONY_CHAT_TEMPLATE = r"""
{#- Every newline of the output is written as "\n" in an expression: transformers renders
    templates with trim_blocks, which would eat newlines written after block tags. -#}
{%- macro ts_type(spec) -%}
{%- if spec is not mapping -%}{{ "any" }}
{%- elif spec.enum is defined -%}{%- for v in spec.enum -%}{{ v | tojson }}{{ " | " if not loop.last }}{%- endfor -%}
{%- elif spec.anyOf is defined or spec.oneOf is defined -%}{%- for s in (spec.anyOf if spec.anyOf is defined else spec.oneOf) -%}{{ ts_type(s) }}{{ " | " if not loop.last }}{%- endfor -%}
{%- elif spec.type is defined and spec.type is not string -%}{%- for t in spec.type -%}{{ ts_type({"type": t, "items": spec.get("items"), "properties": spec.get("properties"), "required": spec.get("required")}) }}{{ " | " if not loop.last }}{%- endfor -%}
{%- elif spec.type == "string" -%}{{ "string" }}
{%- elif spec.type in ("number", "integer") -%}{{ "number" }}
{%- elif spec.type == "boolean" -%}{{ "boolean" }}
{%- elif spec.type == "null" -%}{{ "null" }}
{%- elif spec.type == "array" -%}{{ ts_type(spec.get("items") or {}) }}{{ "[]" }}
{%- elif spec.type == "object" and spec.get("properties") -%}
{{- "{" -}}
{%- for k, v in spec.properties.items() -%}
{{- " " + k + ("" if k in (spec.get("required") or []) else "?") + ": " }}{{ ts_type(v) }}{{ "," -}}
{%- endfor -%}
{{- " }" -}}
{%- elif spec.type == "object" -%}{{ "object" }}
{%- else -%}{{ "any" }}
{%- endif -%}
{%- endmacro -%}
{%- macro render_tools(tools) -%}
{{- "# Tools\n\n## functions\n\nnamespace functions {\n\n" -}}
{%- for tool in tools -%}
{%- set fn = tool.function if tool.function is defined else tool -%}
{%- set params = fn.get("parameters") or {} -%}
{%- if fn.get("description") -%}{{ "// " + fn.description + "\n" }}{%- endif -%}
{{- "type " + fn.name + " = " -}}
{%- if params.get("properties") -%}
{{- "(_: {\n" -}}
{%- for k, v in params.properties.items() -%}
{%- if v is mapping and v.get("description") -%}{{ "// " + v.description + "\n" }}{%- endif -%}
{{- k + ("" if k in (params.get("required") or []) else "?") + ": " }}{{ ts_type(v) }}{{ "," -}}
{%- if v is mapping and v.default is defined -%}{{ " // default: " }}{{ v.default }}{%- endif -%}
{{- "\n" -}}
{%- endfor -%}
{{- "}) => any;\n\n" -}}
{%- else -%}
{{- "() => any;\n\n" -}}
{%- endif -%}
{%- endfor -%}
{{- "} // namespace functions" -}}
{%- endmacro -%}
{%- set ns = namespace(instructions="", first=0, last_user=-1, calls=[]) -%}
{%- if messages and messages[0].role in ("system", "developer") -%}
{%- set ns.instructions = messages[0].content -%}
{%- set ns.first = 1 -%}
{%- endif -%}
{%- for m in messages -%}{%- if m.role == "user" -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{- "<|start|>system<|message|>" -}}
{{- model_identity if model_identity is defined and model_identity else "You are ChatGPT, a large language model trained by OpenAI." -}}
{{- "\nKnowledge cutoff: 2024-06\n" -}}
{%- if strftime_now is defined -%}{{ "Current date: " + strftime_now("%Y-%m-%d") + "\n" }}{%- endif -%}
{{- "\nReasoning: " -}}
{{- reasoning_effort if reasoning_effort is defined and reasoning_effort else "medium" -}}
{{- "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}{{ "\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif -%}
{{- "<|end|>" -}}
{%- if ns.instructions or tools -%}
{{- "<|start|>developer<|message|>" -}}
{%- if ns.instructions -%}{{ "# Instructions\n\n" + ns.instructions }}{%- if tools -%}{{ "\n\n" }}{%- endif -%}{%- endif -%}
{%- if tools -%}{{ render_tools(tools) }}{%- endif -%}
{{- "<|end|>" -}}
{%- endif -%}
{%- for m in messages[ns.first:] -%}
{%- set i = loop.index0 + ns.first -%}
{%- if m.role == "user" -%}
{{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}
{%- elif m.role in ("system", "developer") -%}
{{- "<|start|>developer<|message|># Instructions\n\n" + m.content + "<|end|>" -}}
{%- elif m.role == "assistant" -%}
{%- set thinking = m.get("reasoning") or m.get("reasoning_content") or m.get("thinking") -%}
{%- if thinking and i > ns.last_user -%}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + thinking + "<|end|>" -}}
{%- endif -%}
{%- if m.get("tool_calls") -%}
{%- if m.content -%}{{ "<|start|>assistant<|channel|>commentary<|message|>" + m.content + "<|end|>" }}{%- endif -%}
{%- set ns.calls = m.tool_calls -%}
{%- for call in m.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- "<|start|>assistant<|channel|>commentary to=functions." + fn.name + " <|constrain|>json<|message|>" -}}
{%- if fn.arguments is string -%}{{ fn.arguments }}{%- else -%}{{ fn.arguments | tojson }}{%- endif -%}
{{- "<|call|>" -}}
{%- endfor -%}
{%- elif m.content -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}
{%- endif -%}
{%- elif m.role == "tool" -%}
{%- set tool = namespace(name=m.get("name")) -%}
{%- for call in ns.calls -%}
{%- if not tool.name and call.get("id") and call.get("id") == m.get("tool_call_id") -%}
{%- set tool.name = (call.function if call.function is defined else call).name -%}
{%- endif -%}
{%- endfor -%}
{%- if not tool.name and ns.calls -%}{%- set tool.name = (ns.calls[0].function if ns.calls[0].function is defined else ns.calls[0]).name -%}{%- endif -%}
{{- "<|start|>functions." + (tool.name or "unknown") + " to=assistant<|channel|>commentary<|message|>" + m.content + "<|end|>" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ "<|start|>assistant" }}{%- endif -%}
""".strip()
