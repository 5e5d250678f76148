use super::*;

fn kv() -> Kv {
    Kv::new(ApiPrefix::new(), "cfg").expect("kv")
}

#[test]
fn bucket_config_maps_to_its_stream() {
    let mut c = KvConfig::new("cfg");
    c.history = 5;
    c.ttl = Some(Duration::from_secs(30));
    c.limit_marker_ttl = Some(Duration::from_secs(60));
    let s = c.stream_config().expect("stream config");
    assert_eq!(s.name, "KV_cfg");
    assert_eq!(s.subjects, vec!["$KV.cfg.>".to_string()]);
    assert_eq!(s.max_msgs_per_subject, Some(5));
    assert_eq!(s.max_age, Some(Duration::from_secs(30)));
    assert_eq!(s.duplicate_window, Some(Duration::from_secs(30)));
    assert_eq!(s.allow_rollup_hdrs, Some(true));
    assert_eq!(s.deny_delete, Some(true));
    assert_eq!(s.allow_direct, Some(true));
    assert_eq!(s.allow_msg_ttl, Some(true));
    assert_eq!(s.subject_delete_marker_ttl, Some(Duration::from_secs(60)));
    assert_eq!(s.discard, Some(DiscardPolicy::New));
    let plain = KvConfig::new("b").stream_config().expect("plain");
    assert_eq!(plain.allow_msg_ttl, None);
    assert_eq!(plain.duplicate_window, Some(Duration::from_secs(120)));
    let mut bad = KvConfig::new("b");
    bad.history = 65;
    assert!(bad.stream_config().is_err());
    assert!(KvConfig::new("a.b").stream_config().is_err());
}

#[test]
fn keys_and_buckets_are_validated() {
    for good in ["a", "a.b", "A-Z_0=9/x", "x.y.z"] {
        assert!(validate_key(good).is_ok(), "{good}");
    }
    for bad in ["", ".a", "a.", "a..b", "a b", "a*", "a>", "ä"] {
        assert!(validate_key(bad).is_err(), "{bad}");
    }
    assert!(validate_bucket("ok_bucket-1").is_ok());
    assert!(validate_bucket("no.dots").is_err());
    assert!(validate_key_pattern("a.*.c").is_ok());
    assert!(validate_key_pattern("a.>").is_ok());
    assert!(validate_key_pattern(">.a").is_err());
}

#[test]
fn write_requests_carry_kv_headers() {
    let kv = kv();
    let r = kv
        .create_request("k", b"v", Some(MsgTtl::After(Duration::from_secs(3))))
        .expect("create");
    assert_eq!(r.subject, "$KV.cfg.k");
    let h = r.headers.expect("headers");
    assert_eq!(h.get("Nats-Expected-Last-Subject-Sequence"), Some("0"));
    assert_eq!(h.get("Nats-TTL"), Some("3s"));
    let r = kv.update_request("k", b"v2", 7).expect("update");
    assert_eq!(
        r.headers
            .expect("h")
            .get("Nats-Expected-Last-Subject-Sequence"),
        Some("7")
    );
    let r = kv.delete_request("k", None).expect("delete");
    assert_eq!(r.headers.expect("h").get("KV-Operation"), Some("DEL"));
    let r = kv.purge_request("k", None).expect("purge");
    let h = r.headers.expect("h");
    assert_eq!(h.get("KV-Operation"), Some("PURGE"));
    assert_eq!(h.get("Nats-Rollup"), Some("sub"));
    let r = kv.get_request("k").expect("get");
    assert_eq!(r.subject, "$JS.API.DIRECT.GET.KV_cfg.$KV.cfg.k");
    assert!(kv.put_request("bad key", b"", None).is_err());
}

fn direct_reply(subject: &str, seq: u64, extra: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Nats-Stream", "KV_cfg").expect("h");
    h.insert("Nats-Subject", subject).expect("h");
    h.insert("Nats-Sequence", &seq.to_string()).expect("h");
    h.insert("Nats-Time-Stamp", "2026-11-29T08:00:00.5Z")
        .expect("h");
    for (n, v) in extra {
        h.insert(n, v).expect("h");
    }
    h
}

#[test]
fn get_replies_decode_puts_deletes_purges_and_expiry_markers() {
    let kv = kv();
    let h = direct_reply("$KV.cfg.k", 4, &[]);
    let e = kv.parse_get("k", Some(&h), b"value").expect("entry");
    assert_eq!(e.value, b"value");
    assert_eq!(e.revision, 4);
    assert_eq!(e.operation, KvOperation::Put);
    assert_eq!(e.created_nanos, 1_795_939_200_500_000_000);
    let h = direct_reply("$KV.cfg.k", 5, &[("KV-Operation", "DEL")]);
    let e = kv.parse_get("k", Some(&h), b"").expect("entry");
    assert!(e.is_deleted());
    assert_eq!(e.operation, KvOperation::Delete);
    let h = direct_reply("$KV.cfg.k", 6, &[("KV-Operation", "PURGE")]);
    assert_eq!(
        kv.parse_get("k", Some(&h), b"").expect("entry").operation,
        KvOperation::Purge
    );
    let h = direct_reply(
        "$KV.cfg.k",
        7,
        &[("Nats-Marker-Reason", "MaxAge"), ("Nats-TTL", "60s")],
    );
    let e = kv.parse_get("k", Some(&h), b"").expect("entry");
    assert_eq!(e.operation, KvOperation::Purge);
    assert_eq!(e.marker, Some(MarkerReason::MaxAge));
    assert_eq!(Kv::create_retry(&Ok(e)), Some(7));
    let h = direct_reply("$KV.cfg.k", 8, &[("Nats-Marker-Reason", "Remove")]);
    assert_eq!(
        kv.parse_get("k", Some(&h), b"").expect("entry").operation,
        KvOperation::Delete
    );
    let nf = HeaderMap::with_status(404, "Message Not Found").expect("status");
    assert_eq!(kv.parse_get("k", Some(&nf), b""), Err(JsError::KeyNotFound));
    let other = direct_reply("$KV.cfg.other", 9, &[]);
    assert_eq!(
        kv.parse_get("k", Some(&other), b""),
        Err(JsError::KeyNotFound)
    );
    let gone = br#"{"error":{"code":404,"err_code":10059,"description":"stream not found"}}"#;
    assert_eq!(kv.parse_get("k", None, gone), Err(JsError::BucketNotFound));
}

struct Fixture {
    w: KvWatcher,
    t0: Instant,
}

fn watcher(options: WatchOptions) -> Fixture {
    let t0 = Instant::now();
    let w = KvWatcher::new(kv(), options, "_INBOX.w", "W", t0).expect("watcher");
    Fixture { w, t0 }
}

fn create_of(w: &mut KvWatcher) -> (u64, serde_json::Value) {
    let mut a = w.poll_action();
    while let Some(
        WatchAction::Subscribe { .. }
        | WatchAction::Unsubscribe { .. }
        | WatchAction::Request {
            kind: WatchRequestKind::DeleteConsumer,
            ..
        },
    ) = a
    {
        a = w.poll_action();
    }
    match a {
        Some(WatchAction::Request {
            kind: WatchRequestKind::CreateConsumer { generation },
            request,
        }) => (
            generation,
            serde_json::from_slice(&request.payload).expect("json"),
        ),
        other => panic!("expected a consumer create, got {other:?}"),
    }
}

fn info_reply(name: &str, pending: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "stream_name": "KV_cfg", "name": name, "config": {}, "num_pending": pending
    }))
    .expect("json")
}

#[allow(clippy::too_many_arguments)]
fn data(
    w: &mut KvWatcher,
    consumer: &str,
    key: &str,
    sseq: u64,
    cseq: u64,
    pending: u64,
    headers: Option<&HeaderMap>,
    now: Instant,
) {
    let reply = format!("$JS.ACK.KV_cfg.{consumer}.1.{sseq}.{cseq}.1700000000000000000.{pending}");
    let subject = format!("$KV.cfg.{key}");
    w.on_message(
        &Delivery {
            subject: &subject,
            reply: Some(&reply),
            headers,
            payload: b"v",
        },
        now,
    );
}

fn events(w: &mut KvWatcher, now: Instant) -> Vec<WatchEvent> {
    std::iter::from_fn(|| w.poll_event(now)).collect()
}

#[test]
fn watcher_reports_entries_in_order_and_initial_values_done() {
    let Fixture { mut w, t0 } = watcher(WatchOptions::default());
    assert_eq!(
        w.poll_action(),
        Some(WatchAction::Subscribe {
            subject: "_INBOX.w.1".into()
        })
    );
    let (generation, body) = create_of(&mut w);
    assert_eq!(generation, 1);
    assert_eq!(body["config"]["deliver_policy"], "last_per_subject");
    assert_eq!(body["config"]["deliver_subject"], "_INBOX.w.1");
    assert_eq!(body["config"]["ack_policy"], "none");
    assert_eq!(body["config"]["flow_control"], true);
    assert_eq!(body["config"]["filter_subject"], "$KV.cfg.>");
    assert_eq!(body["action"], "create");
    data(&mut w, "W_1", "a", 3, 1, 1, None, t0);
    let mut del = HeaderMap::new();
    del.insert("KV-Operation", "DEL").expect("h");
    data(&mut w, "W_1", "b", 5, 2, 0, Some(&del), t0);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&info_reply("W_1", 2)),
        t0,
    );
    let ev = events(&mut w, t0);
    assert_eq!(ev.len(), 3, "{ev:?}");
    assert!(
        matches!(&ev[0], WatchEvent::Entry(e) if e.key == "a" && e.revision == 3 && e.operation == KvOperation::Put)
    );
    assert!(
        matches!(&ev[1], WatchEvent::Entry(e) if e.key == "b" && e.operation == KvOperation::Delete && e.delta == 0)
    );
    assert_eq!(ev[2], WatchEvent::InitialValuesDone);
    assert_eq!(w.last_revision(), 5);
}

#[test]
fn watcher_of_an_empty_bucket_is_done_at_create() {
    let Fixture { mut w, t0 } = watcher(WatchOptions::default());
    let _ = create_of(&mut w);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&info_reply("W_1", 0)),
        t0,
    );
    assert_eq!(events(&mut w, t0), vec![WatchEvent::InitialValuesDone]);
}

#[test]
fn watcher_gap_resets_from_the_last_revision_and_ignores_the_old_consumer() {
    let Fixture { mut w, t0 } = watcher(WatchOptions::default());
    let _ = create_of(&mut w);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&info_reply("W_1", 5)),
        t0,
    );
    data(&mut w, "W_1", "a", 10, 1, 4, None, t0);
    data(&mut w, "W_1", "a", 12, 3, 2, None, t0);
    let ev = events(&mut w, t0);
    assert_eq!(ev.len(), 2);
    assert!(matches!(&ev[1], WatchEvent::Reset { reason } if reason.contains("gap")));
    match w.poll_action() {
        Some(WatchAction::Request {
            kind: WatchRequestKind::DeleteConsumer,
            request,
        }) => assert_eq!(request.subject, "$JS.API.CONSUMER.DELETE.KV_cfg.W_1"),
        other => panic!("expected delete, got {other:?}"),
    }
    assert_eq!(
        w.poll_action(),
        Some(WatchAction::Unsubscribe {
            subject: "_INBOX.w.1".into()
        })
    );
    assert_eq!(
        w.poll_action(),
        Some(WatchAction::Subscribe {
            subject: "_INBOX.w.2".into()
        })
    );
    let (generation, body) = create_of(&mut w);
    assert_eq!(generation, 2);
    assert_eq!(body["config"]["deliver_policy"], "by_start_sequence");
    assert_eq!(body["config"]["opt_start_seq"], 11);
    assert_eq!(body["config"]["deliver_subject"], "_INBOX.w.2");
    assert_eq!(w.consumer_name(), "W_2");
    // Late deliveries of the replaced consumer are dropped.
    data(&mut w, "W_1", "a", 13, 4, 1, None, t0);
    // A late reply for the old generation is ignored too.
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&info_reply("W_1", 5)),
        t0,
    );
    assert!(events(&mut w, t0).is_empty());
    data(&mut w, "W_2", "a", 11, 1, 1, None, t0);
    let ev = events(&mut w, t0);
    assert!(matches!(&ev[0], WatchEvent::Entry(e) if e.revision == 11));
    assert_eq!(w.resets(), 1);
}

#[test]
fn a_resync_watch_reads_every_key_again_after_a_reset_or_a_restart() {
    let options = WatchOptions {
        resync: true,
        ..WatchOptions::default()
    };
    let Fixture { mut w, t0 } = watcher(options);
    let _ = create_of(&mut w);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&info_reply("W_1", 2)),
        t0,
    );
    data(&mut w, "W_1", "a", 10, 1, 1, None, t0);
    data(&mut w, "W_1", "b", 12, 2, 0, None, t0);
    let ev = events(&mut w, t0);
    assert_eq!((ev.len(), &ev[0]), (4, &WatchEvent::Resync), "{ev:?}");
    data(&mut w, "W_1", "a", 14, 4, 0, None, t0);
    let ev = events(&mut w, t0);
    assert!(
        matches!(&ev[..], [WatchEvent::Reset { reason }, WatchEvent::Resync] if reason.contains("gap"))
    );
    let (generation, body) = create_of(&mut w);
    assert_eq!(generation, 2);
    assert_eq!(body["config"]["deliver_policy"], "last_per_subject");
    assert_eq!(body["config"].get("opt_start_seq"), None);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 2 },
        Ok(&info_reply("W_2", 1)),
        t0,
    );
    data(&mut w, "W_2", "a", 14, 1, 0, None, t0);
    let ev = events(&mut w, t0);
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert_eq!(ev[1], WatchEvent::InitialValuesDone, "told again");
    w.restart("reconnected", t0);
    assert!(matches!(
        &events(&mut w, t0)[..],
        [WatchEvent::Reset { .. }, WatchEvent::Resync]
    ));
    let (generation, body) = create_of(&mut w);
    assert_eq!(generation, 3);
    assert_eq!(body["config"]["deliver_policy"], "last_per_subject");
    assert_eq!(w.resyncs(), 3);
}

fn resumed_reply(name: &str, consumer_seq: u64, stream_seq: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "stream_name": "KV_cfg", "name": name, "config": {}, "num_pending": 0,
        "delivered": {"consumer_seq": consumer_seq, "stream_seq": stream_seq}
    }))
    .expect("json")
}

#[test]
fn a_resync_watch_resumes_within_half_the_lifetime_after_it_was_last_caught_up() {
    let options = WatchOptions {
        resync: true,
        resume_within_lifetime: Some(Duration::from_secs(10)),
        ..WatchOptions::default()
    };
    let Fixture { mut w, t0 } = watcher(options);
    let _ = create_of(&mut w);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&info_reply("W_1", 1)),
        t0,
    );
    data(&mut w, "W_1", "a", 10, 1, 0, None, t0);
    events(&mut w, t0);
    // Back 4 s after the last delivery: resumed after revision 10.
    let t1 = t0 + Duration::from_secs(4);
    w.restart("reconnected", t1);
    assert!(matches!(
        &events(&mut w, t1)[..],
        [WatchEvent::Reset { .. }]
    ));
    let (_, body) = create_of(&mut w);
    assert_eq!(body["config"]["deliver_policy"], "by_start_sequence");
    assert_eq!(body["config"]["opt_start_seq"], 11);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 2 },
        Ok(&resumed_reply("W_2", 0, 10)),
        t1,
    );
    assert_eq!(events(&mut w, t1), []);
    // Caught up at the create (nothing pending); back 6 s later: read again.
    let t2 = t1 + Duration::from_secs(6);
    w.restart("reconnected", t2);
    assert!(matches!(
        &events(&mut w, t2)[..],
        [WatchEvent::Reset { .. }, WatchEvent::Resync]
    ));
    let (_, body) = create_of(&mut w);
    assert_eq!(body["config"]["deliver_policy"], "last_per_subject");
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 3 },
        Ok(&info_reply("W_3", 1)),
        t2,
    );
    data(&mut w, "W_3", "a", 20, 1, 0, None, t2);
    events(&mut w, t2);
    // Resumed in time, but the stream starts the consumer past revision 20: read again.
    w.restart("reconnected", t2);
    let _ = create_of(&mut w);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 4 },
        Ok(&resumed_reply("W_4", 0, 25)),
        t2,
    );
    let ev = events(&mut w, t2);
    assert!(
        matches!(&ev[..], [WatchEvent::Reset { .. }, WatchEvent::Reset { reason }, WatchEvent::Resync] if reason.contains("not after revision 20")),
        "{ev:?}"
    );
    let (generation, body) = create_of(&mut w);
    assert_eq!(generation, 5);
    assert_eq!(body["config"]["deliver_policy"], "last_per_subject");
    assert_eq!(w.resyncs(), 3);
}

#[test]
fn a_resumed_watch_whose_deliveries_come_before_its_create_answer_stays_resumed() {
    // The server starts pushing before it answers the create, and the answer tells the
    // consumer as made (nothing delivered): compared with the revision the deliveries
    // had reached, it read as a consumer started past the gap, and the watch read the
    // whole bucket again (seen in CI: "starts the consumer after 201, not after revision
    // 203").
    let options = WatchOptions {
        resync: true,
        resume_within_lifetime: Some(Duration::from_secs(10)),
        ..WatchOptions::default()
    };
    let Fixture { mut w, t0 } = watcher(options);
    let _ = create_of(&mut w);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&info_reply("W_1", 1)),
        t0,
    );
    data(&mut w, "W_1", "a", 10, 1, 0, None, t0);
    events(&mut w, t0);
    let t1 = t0 + Duration::from_secs(1);
    w.restart("reconnected", t1);
    events(&mut w, t1);
    let (_, body) = create_of(&mut w);
    assert_eq!(body["config"]["opt_start_seq"], 11);
    data(&mut w, "W_2", "b", 11, 1, 1, None, t1);
    data(&mut w, "W_2", "c", 12, 2, 0, None, t1);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 2 },
        Ok(&resumed_reply("W_2", 0, 10)),
        t1,
    );
    let ev = events(&mut w, t1);
    assert!(
        ev.iter().all(|e| matches!(e, WatchEvent::Entry(_))),
        "{ev:?}"
    );
    assert_eq!(w.resyncs(), 1);
}

#[test]
fn watcher_answers_flow_control_and_checks_heartbeats() {
    let Fixture { mut w, t0 } = watcher(WatchOptions::default());
    let _ = create_of(&mut w);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&info_reply("W_1", 1)),
        t0,
    );
    let fc = HeaderMap::with_status(100, "FlowControl Request").expect("h");
    w.on_message(
        &Delivery {
            subject: "_INBOX.w.1",
            reply: Some("$JS.FC.KV_cfg.x.1"),
            headers: Some(&fc),
            payload: b"",
        },
        t0,
    );
    assert_eq!(
        w.poll_action(),
        Some(WatchAction::Publish(Request::new(
            "$JS.FC.KV_cfg.x.1".into(),
            Vec::new()
        )))
    );
    let mut hb = HeaderMap::with_status(100, "Idle Heartbeat").expect("h");
    hb.insert("Nats-Last-Consumer", "0").expect("h");
    fn hb_msg(h: &HeaderMap) -> Delivery<'_> {
        Delivery {
            subject: "_INBOX.w.1",
            reply: None,
            headers: Some(h),
            payload: b"",
        }
    }
    w.on_message(&hb_msg(&hb), t0);
    assert!(w.poll_action().is_none());
    hb.insert("Nats-Last-Consumer", "2").expect("h");
    w.on_message(&hb_msg(&hb), t0);
    let ev = events(&mut w, t0);
    assert!(matches!(&ev[0], WatchEvent::Reset { reason } if reason.contains("heartbeat")));
    let (generation, _) = create_of(&mut w);
    assert_eq!(generation, 2);
}

#[test]
fn silent_watcher_resets_after_three_heartbeats_and_create_failures_retry() {
    let options = WatchOptions {
        idle_heartbeat: Duration::from_secs(1),
        ..WatchOptions::default()
    };
    let Fixture { mut w, t0 } = watcher(options);
    let _ = create_of(&mut w);
    assert_eq!(w.poll_timeout(), Some(t0 + Duration::from_secs(3)));
    w.handle_timeout(t0 + Duration::from_secs(2));
    assert!(w.poll_action().is_none());
    let t3 = t0 + Duration::from_secs(3);
    w.handle_timeout(t3);
    let (generation, _) = create_of(&mut w);
    assert_eq!(generation, 2);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 2 },
        Err(JsError::Timeout),
        t3,
    );
    let retry_at = w.poll_timeout().expect("retry");
    assert_eq!(retry_at, t3 + Duration::from_millis(500));
    w.handle_timeout(retry_at);
    let (generation, _) = create_of(&mut w);
    assert_eq!(generation, 3);
    let gone = br#"{"error":{"code":404,"err_code":10059,"description":"stream not found"}}"#;
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 3 },
        Ok(gone),
        retry_at,
    );
    let ev = events(&mut w, retry_at);
    assert_eq!(
        ev.last(),
        Some(&WatchEvent::Failed(JsError::BucketNotFound))
    );
    assert!(w.is_stopped());
    assert_eq!(w.poll_timeout(), None);
}

#[test]
fn full_event_queue_stops_taking_deliveries_then_resets_from_the_last_reported() {
    let options = WatchOptions {
        max_pending_events: 2,
        ..WatchOptions::default()
    };
    let Fixture { mut w, t0 } = watcher(options);
    let _ = create_of(&mut w);
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&info_reply("W_1", 9)),
        t0,
    );
    for i in 1..=4 {
        data(&mut w, "W_1", "k", i, i, 9 - i, None, t0);
    }
    let ev = events(&mut w, t0);
    assert_eq!(ev.len(), 3, "{ev:?}");
    assert!(matches!(&ev[2], WatchEvent::Reset { .. }));
    let (_, body) = create_of(&mut w);
    assert_eq!(body["config"]["opt_start_seq"], 3);
}

#[test]
fn updates_only_watch_is_done_at_once_and_delivers_new() {
    let options = WatchOptions {
        updates_only: true,
        keys: vec!["a.*".into(), "b".into()],
        ..WatchOptions::default()
    };
    let Fixture { mut w, t0 } = watcher(options);
    let (_, body) = create_of(&mut w);
    assert_eq!(body["config"]["deliver_policy"], "new");
    assert_eq!(
        body["config"]["filter_subjects"],
        serde_json::json!(["$KV.cfg.a.*", "$KV.cfg.b"])
    );
    assert_eq!(events(&mut w, t0), vec![WatchEvent::InitialValuesDone]);
}

#[test]
fn bucket_config_read_back_from_its_stream_keeps_extra_fields() {
    let mut c = KvConfig::new("rt");
    c.history = 7;
    c.ttl = Some(Duration::from_secs(90));
    c.max_bytes = Some(1 << 20);
    c.storage = StorageType::Memory;
    c.limit_marker_ttl = Some(Duration::from_secs(5));
    c.extra
        .insert("compression".into(), serde_json::json!("s2"));
    let stream = c.stream_config().expect("stream config");
    assert_eq!(
        stream.extra.get("compression"),
        Some(&serde_json::json!("s2"))
    );
    // As the server would send it back, with fields of its own.
    let mut text = serde_json::to_value(&stream).expect("json");
    text["consumer_limits"] = serde_json::json!({});
    let read: StreamConfig = serde_json::from_value(text).expect("parse");
    let back = KvConfig::from_stream_config(&read).expect("kv config");
    assert_eq!(back.bucket, "rt");
    assert_eq!(back.history, 7);
    assert_eq!(back.ttl, Some(Duration::from_secs(90)));
    assert_eq!(back.max_bytes, Some(1 << 20));
    assert_eq!(back.storage, StorageType::Memory);
    assert_eq!(back.limit_marker_ttl, Some(Duration::from_secs(5)));
    assert!(back.extra.contains_key("consumer_limits"));
    let again = back.stream_config().expect("again");
    assert_eq!(
        serde_json::to_value(&again).expect("json"),
        serde_json::to_value(&read).expect("json")
    );
    assert!(KvConfig::from_stream_config(&StreamConfig::new("ORDERS", &[])).is_err());
}

#[test]
fn extreme_sequences_from_the_server_do_not_overflow() {
    let Fixture { mut w, t0 } = watcher(WatchOptions::default());
    let _ = create_of(&mut w);
    data(&mut w, "W_1", "a", u64::MAX, 1, u64::MAX, None, t0);
    data(&mut w, "W_1", "a", 1, u64::MAX, 0, None, t0);
    data(&mut w, "W_1", "a", 1, 2, 0, None, t0);
    let ev = events(&mut w, t0);
    assert!(matches!(&ev[0], WatchEvent::Entry(e) if e.revision == u64::MAX));
    let (_, body) = create_of(&mut w);
    assert_eq!(body["config"]["opt_start_seq"], u64::MAX);
    let page: crate::jetstream::NamesPage = serde_json::from_str(
        r#"{"total":18446744073709551615,"offset":18446744073709551615,"streams":["a"]}"#,
    )
    .expect("page");
    assert_eq!(page.next_offset(), None);
}

#[test]
fn updates_only_watch_reset_before_any_entry_resumes_after_the_stream_end_it_started_at() {
    let options = WatchOptions {
        updates_only: true,
        idle_heartbeat: Duration::from_secs(1),
        ..WatchOptions::default()
    };
    let Fixture { mut w, t0 } = watcher(options);
    let _ = create_of(&mut w);
    let reply = serde_json::to_vec(&serde_json::json!({
        "stream_name": "KV_cfg", "name": "W_1", "config": {}, "num_pending": 0,
        "delivered": {"consumer_seq": 0, "stream_seq": 41}
    }))
    .expect("json");
    w.on_reply(
        WatchRequestKind::CreateConsumer { generation: 1 },
        Ok(&reply),
        t0,
    );
    w.handle_timeout(t0 + Duration::from_secs(3));
    let (generation, body) = create_of(&mut w);
    assert_eq!(generation, 2);
    assert_eq!(body["config"]["deliver_policy"], "by_start_sequence");
    assert_eq!(body["config"]["opt_start_seq"], 42);
}
