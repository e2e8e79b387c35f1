"""Helpers for chapter 09's answers in tests/course/test_course_checks_ch09.py, in a module that imports only
``json``: the check runs an answer again in fresh Python processes (``built_in_other_processes``), which import
what the answer uses from here, not the test module with the whole course behind it (seconds per process)."""

from __future__ import annotations

import json


def _tool_lines(tools, sort_tools=True, sort_keys=True):
    ordered = sorted(tools, key=lambda tool: tool["name"]) if sort_tools else tools
    return [json.dumps(tool, sort_keys=sort_keys) for tool in ordered]


def _messages(system, user):
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
