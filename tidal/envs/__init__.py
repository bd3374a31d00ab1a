"""The environments: what an episode does between the policy's turns (tidal/envs/base.py holds the
protocol), and the table of the built-in ones that `task.env` names.

`task.env` is a name of BUILTIN_ENVS or a dotted or file path to a user's class; the runtime
imports the class named here (tidal/runtime/tasks.py), so importing this package imports no
environment. Without a dataset, `single_turn` is the generated arithmetic task
(`GENERATED_TASK`), whose problem distribution is its `task.env_args` (min_digits, max_digits, ops).
"""

BUILTIN_ENVS = {
    "single_turn": "tidal.envs.single_turn:SingleTurnEnv",
    "tool_arith": "tidal.envs.tool_arith:ToolArithEnv",
    "vlm_color": "tidal.envs.image_tasks:ColorEnv",
    "vlm_count": "tidal.envs.image_tasks:CountEnv",
    "vlm_zoom": "tidal.envs.image_tasks:ZoomEnv",
    "code": "tidal.envs.code:CodeEnv",
    "shell": "tidal.envs.shell:ShellEnv",
    "browser": "tidal.envs.browser:BrowserEnv",
    "openai_agent": "tidal.envs.openai_agent:OpenAIAgentEnv",
    "tidal.envs.openai_agent": "tidal.envs.openai_agent:OpenAIAgentEnv",
}
GENERATED_TASK = "tidal.envs.single_turn:ArithmeticEnv"  # task.env=single_turn without task.dataset
