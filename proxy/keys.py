"""Typed application keys: every long-lived object of a proxy app lives under one of these."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.bluegreen import BlueGreen
from proxy.config import ProxyConfig
from proxy.connections import ConnectionGate
from proxy.pool import WorkerPool
from proxy.relay import Relay
from proxy.stats import Stats
from proxy.timeline import OptimizerTimeline
from proxy.traces import TraceWriter

CONFIG = web.AppKey("config", ProxyConfig)
POOL = web.AppKey("pool", WorkerPool)
STATS = web.AppKey("stats", Stats)
RELAY = web.AppKey("relay", Relay)
TRACES = web.AppKey("traces", TraceWriter)
# Open client connections against limits.max_connections (proxy.connections).
GATE = web.AppKey("gate", ConnectionGate)
REGISTRY = web.AppKey("registry", CollectorRegistry)
DASHBOARD = web.AppKey("dashboard", bytes)
BLUEGREEN = web.AppKey("bluegreen", BlueGreen)
# The background optimizer service, when `optimize.enabled` (0 or 1 item).
OPTIMIZER = web.AppKey("optimizer", list)
# What the optimizer did, for the dashboard (proxy.dashboard).
TIMELINE = web.AppKey("timeline", OptimizerTimeline)
