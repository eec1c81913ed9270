"""The outside view: metrics, the acceptance canary, the front process's view, the weight checker, the stat
logger. It reads every layer below it; nothing below imports it."""
