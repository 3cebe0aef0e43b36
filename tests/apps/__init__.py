"""Tests of zeropipe/apps."""
