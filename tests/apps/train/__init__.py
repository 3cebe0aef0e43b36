"""Tests of zeropipe/apps/train."""
