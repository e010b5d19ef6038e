"""Llama 3 and Qwen style tokenizer folders written on the spot: a byte-level BPE trained on a few chats, the
family's pre-tokenizer pattern and special tokens, and its chat template in tokenizer_config.json (nothing is
downloaded). The templates are Meta-Llama-3-8B-Instruct's and Qwen3's (tool calls left out, two long tags broken
over lines); the `_GENERATION` variants wrap the assistant's answer and end-of-turn token in `{% generation %}`,
for transformers' assistant mask. The "tools" templates are Qwen2.5-Instruct's and Qwen3's whole, tool calls
included (long tags broken over lines); their "tools_generation" variants wrap the calls and the end-of-turn token
that follows them.
"""

from __future__ import annotations

import json

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
QWEN3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_GENERATION = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_QWEN3_HEAD = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
          and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                    .split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' }}
"""
_QWEN3_ANSWER = """        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>' }}
"""
_QWEN3_TAIL = """        {{- '\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
QWEN3_TEMPLATE = _QWEN3_HEAD + _QWEN3_ANSWER + _QWEN3_TAIL
QWEN3_GENERATION = (
    _QWEN3_HEAD + "        {%- generation %}\n" + _QWEN3_ANSWER + "        {%- endgeneration %}\n" + _QWEN3_TAIL
)

_QWEN_TOOLS_SYSTEM = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>"
)
_QWEN_TOOLS_FORMAT = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n"
)
QWEN25_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n""" + _QWEN_TOOLS_SYSTEM + """" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- \"""" + _QWEN_TOOLS_FORMAT + """" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
          or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN3_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- \"""" + _QWEN_TOOLS_SYSTEM + """" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- \"""" + _QWEN_TOOLS_FORMAT + """" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
          and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                    .split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')
                    + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def _calls_in_generation(template: str, calls_start: str) -> str:
    """`template` with its tool calls and the end-of-turn token after them in one {% generation %} block."""
    end_of_turn = "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
    assert template.count(calls_start) == 1 and template.count(end_of_turn) == 1
    return template.replace(calls_start, "        {%- generation %}\n" + calls_start).replace(
        end_of_turn,
        "        {{- '<|im_end|>' }}\n        {%- endgeneration %}\n        {{- '\\n' }}\n"
        "    {%- elif message.role == \"tool\" %}",
    )


QWEN25_TOOLS_GENERATION = _calls_in_generation(QWEN25_TOOLS, "        {%- for tool_call in message.tool_calls %}")
QWEN3_TOOLS_GENERATION = _calls_in_generation(QWEN3_TOOLS, "        {%- if message.tool_calls %}")

CORPUS = [
    "You are a careful calculator. What is 12 + 30? 12 + 30 = 42.",
    "Hello there! How are you today? I am fine, thank you.",
    "<think>\nThe user adds numbers.\n</think>\n\nThe answer is 7.",
    "system user assistant tool\n\n",
]
# Qwen's <tool_call> tags are added tokens that are not special, as in its tokenizer_config.json.
QWEN_SPECIALS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False), ("</think>", False),
    ("<tool_call>", False), ("</tool_call>", False),
]
FAMILIES = {
    "llama3": {
        "pattern": LLAMA3_PATTERN,
        "specials": [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
                     ("<|end_header_id|>", True), ("<|eot_id|>", True)],
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "templates": {"plain": LLAMA3_TEMPLATE, "generation": LLAMA3_GENERATION},
    },
    "qwen3": {
        "pattern": QWEN3_PATTERN,
        "specials": QWEN_SPECIALS, "bos_token": None, "eos_token": "<|im_end|>",
        "templates": {
            "plain": QWEN3_TEMPLATE, "generation": QWEN3_GENERATION, "tools": QWEN3_TOOLS,
            "tools_generation": QWEN3_TOOLS_GENERATION,
        },
    },
    "qwen2.5": {
        "pattern": QWEN3_PATTERN, "specials": QWEN_SPECIALS, "bos_token": None, "eos_token": "<|im_end|>",
        "templates": {"tools": QWEN25_TOOLS, "tools_generation": QWEN25_TOOLS_GENERATION},
    },
}


def write_chat_tokenizer(folder, family: str, template: str | None = "plain"):
    """A tokenizer folder of `family` (llama3, qwen3 or qwen2.5) with its template ("plain", "generation", "tools",
    "tools_generation" or None: none)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec["pattern"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(token, special=special, normalized=False) for token, special in spec["specials"]])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    decoder = {
        str(tokenizer.token_to_id(content)): {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special,
        }
        for content, special in spec["specials"]
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": decoder,
        "bos_token": spec["bos_token"], "eos_token": spec["eos_token"], "model_max_length": 4096,
    }
    if template is not None:
        config["chat_template"] = spec["templates"][template]
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder
