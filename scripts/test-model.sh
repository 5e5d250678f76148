#!/usr/bin/env bash
# The differential run: the JetStream, KV, core NATS and broker test bodies that need only
# a plain server, against the in-process NATS/JetStream model (AMP_TEST_NATS=model)
# instead of nats-server. scripts/test.sh runs them against nats-server first.
#
# Left out, because they need what the model does not have: accounts and permissions
# (account_without_jetstream_..., permission_violation_...), a server without JetStream
# (server_without_jetstream_..., which starts its own nats-server anyway), stopping the
# server process by PID (submits_waiting_for_a_budget_reservation_...,
# a_session_holds_at_most_its_share_of_requests_in_flight,
# submit_bodies_waiting_for_jetstream_...,
# a_confirmed_ack_of_a_moved_delivery_...), the 10,000-task
# run (two_brokers_and_four_workers_...: it passes, but the model's linear scans make it
# take about ten minutes), a server's `jetstream { limits { duplicate_window } }`
# (a_server_duplicate_window_limit_...: the model has no server limits),
# and hostile_nats (a CR inside a PUB control line, which nats-server takes and
# src/proto's server-side parser refuses; a client flooding MIG request subjects, which
# measures how nats-server queues for a broker's connections; a broker's main link frozen
# by a relay, its ingress unsubscribing seen in nats-server's `connz`, its `/readyz`, its
# refusing requests meanwhile and its giving the link up to dial again timed against
# nats-server). Also left out:
# tests of auth, TLS, clusters, leaf nodes, reconnects and MIG (accounts and the auth
# callout).
set -euo pipefail
cd "$(dirname "$0")/.."
tests=(
  jetstream_acks jetstream_consumers jetstream_publish jetstream_streams jetstream_faults
  kv_basic kv_watch nats_connection
  jetstream_interop_nats_py
  amp_fast_path broker_budget broker_contract broker_restarts broker_sessions broker_topics
  dead_letters hostile_config hostile_jobs hostile_topics hostile_transport jobs_engine
  jobs_faults jobs_sessions logs lost_streams operator_probes policy_budget reload stream_adoption
  ws_transport
)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
AMP_TEST_NATS=model cargo test "${args[@]}" -- \
  --skip account_without_jetstream_is_not_enabled_for_account_10039 \
  --skip server_without_jetstream_is_not_enabled \
  --skip permission_violation_is_reported_and_keeps_the_connection \
  --skip submits_waiting_for_a_budget_reservation_are_capped_per_participant \
  --skip a_session_holds_at_most_its_share_of_requests_in_flight \
  --skip a_participant_holds_at_most_its_share_of_requests_in_flight_over_all_its_sessions \
  --skip submit_bodies_waiting_for_jetstream_are_bounded_in_bytes \
  --skip a_confirmed_ack_of_a_moved_delivery_that_timed_out_can_be_sent_again \
  --skip two_brokers_and_four_workers_complete_ten_thousand_tasks_exactly_once_with_even_load \
  --skip a_server_duplicate_window_limit_below_the_longest_lease_and_90_s_keeps_120_s_and_starts
