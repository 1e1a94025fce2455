#!/usr/bin/env bash
# plan_ab.sh with A = the plan this code's selection takes at 17-32 rows (step check included)
# against B = int8_amx for the four layer shapes.
#   bash bench/results/session30/plan_ab_final.sh [ROUNDS] > bench/results/session30/plan_ab_final.txt
A=measured exec bash "$(dirname "$0")/plan_ab.sh" "$@"
