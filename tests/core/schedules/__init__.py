"""Tests of zeropipe/core/schedules."""
