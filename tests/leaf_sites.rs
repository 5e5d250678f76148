//! Leaf-node sites: a hub nats-server (JetStream domain `hub`) with its broker, and a site
//! broker whose embedded nats-server is a leaf node of the hub (domain `site1`) through a
//! TCP relay the test owns, so the link can be cut and restored. Namespace `fleet` lives
//! in the hub's domain and is served at both; namespace `local` lives at the site.

mod common;

use std::time::{Duration, Instant};

use amp_broker::broker::binding;
use amp_broker::jwt;
use amp_broker::nats::{self, creds};
use amp_broker::nkeys::{KeyKind, KeyPair};
use common::NatsServer;
use common::amp::{Broker, Client, token_hash};
use common::relay::Relay;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(15);

fn participants(names: &[&str]) -> Value {
    let all = json!([">"]);
    names
        .iter()
        .map(|n| {
            let p = json!({
                "token_sha256": token_hash(&format!("{n}-token")),
                "permissions": {"send": all, "publish": all, "subscribe": all, "submit": all, "serve": all},
            });
            (n.to_string(), p)
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn fleet() -> Value {
    json!({
        "jetstream_domain": "hub",
        "participants": participants(&["alice", "bob"]),
        "jobs": {"render": {"lease_s": 30, "offer_ms": 5000, "max_attempts": 3}},
        "inbox": {"ack_wait_s": 5},
    })
}

fn hub_config() -> Value {
    json!({"namespaces": {"fleet": fleet()}})
}

fn site_config() -> Value {
    json!({"namespaces": {
        "fleet": fleet(),
        "local": {"participants": participants(&["carol", "dave"])},
    }})
}

/// A hub on `leaf_port`: JetStream domain `hub`, leaf nodes only with the leaf password.
/// It does not advertise its leaf address: a site told of it would reconnect there
/// straight, past the relay, and a cut link would heal by itself (a CI run saw a send
/// stored at the hub right after the cut).
fn hub_on(leaf_port: u16) -> NatsServer {
    NatsServer::with_jetstream(
        "  domain: hub",
        &format!(
            "server_name: hub\nleafnodes {{\n  listen: 127.0.0.1:{leaf_port}\n  \
             no_advertise: true\n  \
             authorization {{ user: site, password: leaf-secret }}\n}}\n"
        ),
    )
}

fn hub() -> (NatsServer, u16) {
    let leaf_port = common::free_port();
    (hub_on(leaf_port), leaf_port)
}

fn site_broker(relay: &Relay) -> Broker {
    Broker::start_embedded(
        &site_config(),
        &[
            "--broker-id",
            "site1",
            "--leaf-remote",
            &format!("nats-leaf://site:leaf-secret@{}", relay.addr()),
            "--js-domain",
            "site1",
        ],
    )
}

fn login(broker: &Broker, ns: &str, name: &str) -> Client {
    Client::login(broker, ns, name, &format!("{name}-token"))
}

/// Sends until the broker answers `ok` (the leaf link needs a moment after start or
/// restore); every try uses the same `idem`, so the message is stored once.
fn send_until_ok(c: &mut Client, to: &str, body: Value, idem: &str) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let r = c.request(json!({"op":"send","to":to,"body":body,"idem":idem}));
        if r["op"] == "ok" || Instant::now() >= deadline {
            return r;
        }
        assert_eq!(r["code"], "unavailable", "{r}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Reads and acks messages until `n` first deliveries arrived or nothing more comes
/// within a second. A redelivery (`delivery` > 1: the inbox is at-least-once, and a
/// message left unread past `ack_wait_s` while the test waits on something else comes
/// again) is acked and left out; its first delivery was read, or is missing here.
fn receive(c: &mut Client, n: usize) -> Vec<Value> {
    let mut got = Vec::new();
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        let Some(m) = c.next_op("message", Duration::from_secs(1)) else {
            if got.len() >= n {
                break;
            }
            continue;
        };
        c.send(&json!({"op":"ack","seq":m["seq"]}));
        if m["delivery"].as_u64().is_none_or(|d| d <= 1) {
            got.push(m);
        }
    }
    // Anything past n is a second store.
    got
}

fn names(who: &Value) -> Vec<String> {
    let mut names: Vec<String> = who["participants"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["name"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn a_leaf_site_serves_fleet_and_local_namespaces_and_rides_out_a_cut_uplink() {
    let (hub, leaf_port) = hub();
    let relay = Relay::start(&format!("127.0.0.1:{leaf_port}"));
    let hub_broker = Broker::start_with(&hub.url(), &hub_config(), &["--broker-id", "hub"]);
    let site = site_broker(&relay);

    let mut alice = login(&hub_broker, "fleet", "alice");
    let mut bob = Client::connect(&site);
    let ok = bob.request(json!({
        "op":"hello","ns":"fleet","name":"bob",
        "auth":{"type":"token","token":"bob-token"},
        "serve":[{"job":"render","slots":1}]
    }));
    assert_eq!(ok["op"], "ok", "{ok}");
    let mut carol = login(&site, "local", "carol");
    let mut dave = login(&site, "local", "dave");

    // Fleet traffic crosses the leaf link both ways.
    let r = send_until_ok(&mut bob, "alice", json!("from the site"), "b1");
    assert_eq!(r["op"], "ok", "{r}\nsite log:\n{}", site.log());
    let r = send_until_ok(&mut alice, "bob", json!("from the hub"), "a1");
    assert_eq!(r["op"], "ok", "{r}");
    let got = receive(&mut alice, 1);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["body"], "from the site");
    assert_eq!(got[0]["from"], "fleet/bob");
    let got = receive(&mut bob, 1);
    assert_eq!(got.len(), 1, "{got:?}\nsite log:\n{}", site.log());
    assert_eq!(got[0]["body"], "from the hub");

    // A task submitted at the hub is offered to the worker at the site.
    let r = alice.request(json!({"op":"submit","job":"render","task":"T1","body":{"frame":1}}));
    assert_eq!(r["op"], "ok", "{r}");
    let offer = bob.next_op("offer", WAIT).expect("offer at the site");
    assert_eq!(offer["task"], "T1", "{offer}");
    assert_eq!(bob.request(json!({"op":"claim","task":"T1"}))["op"], "ok");
    assert_eq!(
        bob.request(json!({"op":"complete","task":"T1","result":"done"}))["op"],
        "ok"
    );
    let result = alice
        .next_op("message", WAIT)
        .expect("task_result at the hub");
    assert_eq!(result["kind"], "task_result", "{result}");
    alice.send(&json!({"op":"ack","seq":result["seq"]}));

    // Presence of the fleet namespace spans hub and site.
    let deadline = Instant::now() + WAIT;
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        seen = names(&alice.request(json!({"op":"who"})));
        if seen == ["alice", "bob"] {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        seen,
        ["alice", "bob"],
        "who at the hub\nsite log:\n{}\nhub broker log:\n{}",
        site.log(),
        hub_broker.log()
    );
    assert_eq!(names(&bob.request(json!({"op":"who"}))), ["alice", "bob"]);

    // The link goes down.
    relay.cut();
    let cut_at = Instant::now();
    let during = loop {
        let r = bob.request(json!({"op":"send","to":"alice","body":"during","idem":"b2"}));
        if r["op"] != "ok" || cut_at.elapsed() > WAIT {
            break r;
        }
        // The leaf connection may not have noticed yet: that send was stored at the hub.
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(during["code"], "unavailable", "{during}");
    // A request caught in flight by the cut waits for the broker's 4 s JetStream timeout;
    // requests made while the link is down are answered at once (below).
    let first_unavailable = cut_at.elapsed();
    assert!(
        first_unavailable < Duration::from_secs(5),
        "unavailable after {first_unavailable:?}"
    );
    let started = Instant::now();
    let r = bob.request(json!({"op":"send","to":"alice","body":"during","idem":"b2"}));
    assert_eq!(r["code"], "unavailable", "{r}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let r = bob.request(json!({"op":"submit","job":"render","task":"T2","body":1}));
    assert_eq!(r["code"], "unavailable", "{r}");
    assert_eq!(
        bob.request(json!({"op":"ping"}))["op"],
        "ok",
        "the session stays up"
    );
    // The local namespace does not need the hub.
    assert_eq!(
        carol.request(json!({"op":"send","to":"dave","body":"offline"}))["op"],
        "ok"
    );
    let got = receive(&mut dave, 1);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["body"], "offline");
    // The hub side keeps working too; its message for bob waits in the hub's stream.
    assert_eq!(
        alice.request(json!({"op":"send","to":"bob","body":"while cut","idem":"a2"}))["op"],
        "ok"
    );

    // The link returns: everything resumes by itself.
    relay.restore();
    let restored_at = Instant::now();
    let r = send_until_ok(&mut bob, "alice", json!("during"), "b2");
    assert_eq!(r["op"], "ok", "{r}\nsite log:\n{}", site.log());
    eprintln!(
        "leaf link: unavailable {:?} after the cut; sends ok {:?} after the restore",
        first_unavailable,
        restored_at.elapsed()
    );
    let got = receive(&mut bob, 1);
    assert_eq!(got.len(), 1, "{got:?}\nsite log:\n{}", site.log());
    assert_eq!(got[0]["body"], "while cut");
    let r = bob.request(json!({"op":"submit","job":"render","task":"T2","body":2}));
    assert_eq!(r["op"], "ok", "{r}");
    let offer = bob.next_op("offer", WAIT).expect("offer after the restore");
    assert_eq!(offer["task"], "T2");
    let got = receive(&mut alice, 1);
    let bodies: Vec<&Value> = got.iter().map(|m| &m["body"]).collect();
    assert_eq!(bodies, [&json!("during")], "stored once: {got:?}");
}

#[test]
fn a_site_whose_hub_is_unreachable_at_start_serves_local_namespaces_until_the_hub_appears() {
    let leaf_port = common::free_port();
    let relay = Relay::start(&format!("127.0.0.1:{leaf_port}"));
    let site = site_broker(&relay);

    let mut carol = login(&site, "local", "carol");
    let mut dave = login(&site, "local", "dave");
    assert_eq!(
        carol.request(json!({"op":"send","to":"dave","body":1}))["op"],
        "ok"
    );
    assert_eq!(receive(&mut dave, 1).len(), 1);

    let mut bob = login(&site, "fleet", "bob");
    let started = Instant::now();
    let r = bob.request(json!({"op":"send","to":"alice","body":"early","idem":"e1"}));
    assert_eq!(r["code"], "unavailable", "{r}");
    assert!(started.elapsed() < Duration::from_secs(5));

    // The hub comes up on the port the site dials, with its broker.
    let hub = hub_on(leaf_port);
    let hub_broker = Broker::start_with(&hub.url(), &hub_config(), &["--broker-id", "hub"]);
    let mut alice = login(&hub_broker, "fleet", "alice");
    let r = send_until_ok(&mut bob, "alice", json!("early"), "e1");
    assert_eq!(r["op"], "ok", "{r}\nsite log:\n{}", site.log());
    let got = receive(&mut alice, 1);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["body"], "early");
    // Bob's inbox, missing when he logged in, is read once the hub is there.
    assert_eq!(
        alice.request(json!({"op":"send","to":"bob","body":"welcome"}))["op"],
        "ok"
    );
    let got = receive(&mut bob, 1);
    assert_eq!(got.len(), 1, "{got:?}\nsite log:\n{}", site.log());
    assert_eq!(got[0]["body"], "welcome");
}

#[test]
fn a_site_that_started_offline_sets_up_the_fleet_streams_itself_when_no_hub_broker_exists() {
    let leaf_port = common::free_port();
    let relay = Relay::start(&format!("127.0.0.1:{leaf_port}"));
    let site = site_broker(&relay);
    let mut bob = Client::connect(&site);
    let ok = bob.request(json!({
        "op":"hello","ns":"fleet","name":"bob",
        "auth":{"type":"token","token":"bob-token"},
        "serve":[{"job":"render","slots":1}]
    }));
    assert_eq!(ok["op"], "ok", "{ok}");
    let mut alice = login(&site, "fleet", "alice");

    // A bare hub nats-server: no broker there ever creates the fleet streams.
    let hub = hub_on(leaf_port);
    let r = send_until_ok(&mut bob, "alice", json!("offline start"), "o1");
    assert_eq!(r["op"], "ok", "{r}\nsite log:\n{}", site.log());
    let got = receive(&mut alice, 1);
    assert_eq!(got.len(), 1, "{got:?}\nsite log:\n{}", site.log());
    assert_eq!(got[0]["body"], "offline start");
    // The site's registry watch asked the hub for the bucket before the site had made
    // it there ("stream not found"); it stopped for good, and `who` answered [].
    let until = Instant::now() + WAIT;
    let mut listed = Vec::new();
    while Instant::now() < until {
        listed = names(&alice.request(json!({"op":"who"})));
        if listed == ["alice", "bob"] {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(listed, ["alice", "bob"], "site log:\n{}", site.log());

    let r = alice.request(json!({"op":"submit","job":"render","task":"T1","body":{"frame":1}}));
    assert_eq!(r["op"], "ok", "{r}");
    let offer = bob.next_op("offer", WAIT).expect("offer at the site");
    assert_eq!(offer["task"], "T1", "{offer}\nsite log:\n{}", site.log());
    assert_eq!(bob.request(json!({"op":"claim","task":"T1"}))["op"], "ok");
    assert_eq!(
        bob.request(json!({"op":"complete","task":"T1","result":"done"}))["op"],
        "ok"
    );
    let result = alice.next_op("message", WAIT).expect("task_result");
    assert_eq!(result["kind"], "task_result", "{result}");

    // The streams live in the hub's domain, not the site's.
    let options = nats::Options::parse_servers(&hub.url()).expect("hub url");
    let mut client = nats::Client::connect(options).expect("connect to the hub");
    let stream = binding::inbox_stream("fleet");
    let info = client
        .request(
            &format!("$JS.hub.API.STREAM.INFO.{stream}"),
            None,
            b"",
            WAIT,
        )
        .expect("stream info");
    let info: Value = serde_json::from_slice(&info.payload).expect("json");
    assert_eq!(info["config"]["name"], stream.as_str(), "{info}");
}

#[test]
fn a_leaf_link_without_the_hub_password_is_refused() {
    let (hub, leaf_port) = hub();
    let relay = Relay::start(&format!("127.0.0.1:{leaf_port}"));
    let _hub_broker = Broker::start_with(&hub.url(), &hub_config(), &["--broker-id", "hub"]);
    let site = Broker::start_embedded(
        &site_config(),
        &[
            "--broker-id",
            "site1",
            "--leaf-remote",
            &format!("nats-leaf://site:wrong@{}", relay.addr()),
        ],
    );
    assert!(
        common::wait_until(WAIT, || hub.log().contains("authentication error")),
        "hub log:\n{}",
        hub.log()
    );
    let mut bob = login(&site, "fleet", "bob");
    let r = bob.request(json!({"op":"send","to":"alice","body":"x"}));
    assert_eq!(r["code"], "unavailable", "{r}");
    let mut carol = login(&site, "local", "carol");
    assert_eq!(
        carol.request(json!({"op":"send","to":"dave","body":1}))["op"],
        "ok"
    );
}

#[test]
fn a_link_that_dies_silently_is_noticed_by_pings_and_fleet_requests_meanwhile_time_out_as_unavailable()
 {
    let (hub, leaf_port) = hub();
    let relay = Relay::start(&format!("127.0.0.1:{leaf_port}"));
    let hub_broker = Broker::start_with(&hub.url(), &hub_config(), &["--broker-id", "hub"]);
    let site = site_broker(&relay);
    let mut alice = login(&hub_broker, "fleet", "alice");
    let mut bob = login(&site, "fleet", "bob");
    let r = send_until_ok(&mut bob, "alice", json!("before"), "f1");
    assert_eq!(r["op"], "ok", "{r}");
    assert_eq!(receive(&mut alice, 1).len(), 1);

    relay.freeze();
    let frozen_at = Instant::now();
    // Until the site's pings notice, requests go into the dead link and time out.
    let mut slowest = Duration::ZERO;
    let noticed = loop {
        let started = Instant::now();
        let r = bob.request(json!({"op":"send","to":"alice","body":"lost?","idem":"f2"}));
        let took = started.elapsed();
        slowest = slowest.max(took);
        assert!(took < Duration::from_secs(5), "answered after {took:?}");
        // The first `ok` (seen about a second after the site gave the link up at its
        // pings' 15 s and dialled again) also ends the wait; it is stored once, as the
        // same `idem` below shows.
        if r["op"] == "ok" {
            let at = frozen_at.elapsed();
            assert!(
                at > Duration::from_secs(10),
                "ok through a frozen link after {at:?}"
            );
            break at;
        }
        assert_eq!(r["code"], "unavailable", "{r}");
        if took < Duration::from_millis(500) {
            break frozen_at.elapsed();
        }
        assert!(
            frozen_at.elapsed() < Duration::from_secs(30),
            "the dead link was not noticed"
        );
    };
    eprintln!("silent link death noticed after {noticed:?}; slowest answer meanwhile {slowest:?}");

    relay.restore();
    let r = send_until_ok(&mut bob, "alice", json!("lost?"), "f2");
    assert_eq!(r["op"], "ok", "{r}\nsite log:\n{}", site.log());
    let got = receive(&mut alice, 1);
    assert_eq!(got.len(), 1, "stored once: {got:?}");
}

/// An operator-mode hub (JWTs in a memory resolver) with a leaf node listener on
/// `leaf_port`; returns it and the account whose users may link.
fn operator_hub(leaf_port: u16) -> (NatsServer, KeyPair) {
    let key = |kind| KeyPair::generate(kind).expect("key");
    let (operator, account, system) = (
        key(KeyKind::Operator),
        key(KeyKind::Account),
        key(KeyKind::Account),
    );
    let sign = |claims, signer: &KeyPair| jwt::encode(&claims, signer).expect("jwt");
    let operator_jwt = sign(
        jwt::operator_claims(&operator.public_key(), "op"),
        &operator,
    );
    let account_jwt = sign(
        jwt::account_claims(&account.public_key(), "fleet"),
        &operator,
    );
    let system_jwt = sign(
        jwt::system_account_claims(&system.public_key(), "SYS"),
        &operator,
    );
    let hub = NatsServer::with_jetstream(
        "  domain: hub",
        &format!(
            "server_name: hub\noperator: {operator_jwt}\nsystem_account: {sys}\n\
             resolver: MEMORY\nresolver_preload: {{\n  {acc}: {account_jwt}\n  {sys}: {system_jwt}\n}}\n\
             leafnodes {{\n  listen: 127.0.0.1:{leaf_port}\n  no_advertise: true\n}}\n",
            acc = account.public_key(),
            sys = system.public_key(),
        ),
    );
    (hub, account)
}

/// A creds file for a new user signed by `account`.
fn user_creds(dir: &std::path::Path, name: &str, account: &KeyPair) -> std::path::PathBuf {
    let user = KeyPair::generate(KeyKind::User).expect("user");
    let token =
        jwt::encode(&jwt::user_claims(&user.public_key(), name, None), account).expect("user jwt");
    let path = dir.join(format!("{name}.creds"));
    std::fs::write(&path, creds::format(&token, &user.seed())).expect("write creds");
    path
}

#[test]
fn leaf_creds_link_a_site_to_an_operator_mode_hub_and_creds_of_another_account_are_refused() {
    let leaf_port = common::free_port();
    let (hub, account) = operator_hub(leaf_port);
    let dir = tempfile::tempdir().expect("dir");
    let site_with = |creds: &std::path::Path, id: &str| {
        Broker::start_embedded(
            &site_config(),
            &[
                "--broker-id",
                id,
                "--leaf-remote",
                &format!("nats-leaf://127.0.0.1:{leaf_port}"),
                "--leaf-creds",
                &creds.display().to_string(),
            ],
        )
    };

    // Creds of a user of another account (one the hub does not trust).
    let stranger = KeyPair::generate(KeyKind::Account).expect("account");
    let refused = site_with(&user_creds(dir.path(), "stranger", &stranger), "site2");
    assert!(
        common::wait_until(WAIT, || hub.log().contains("Authorization Violation")
            || hub.log().contains("authentication error")),
        "hub log:\n{}",
        hub.log()
    );
    let mut bob = login(&refused, "fleet", "bob");
    let r = bob.request(json!({"op":"send","to":"alice","body":"x"}));
    assert_eq!(r["code"], "unavailable", "{r}");
    drop(bob);
    drop(refused);

    // The site's user: the link comes up and the fleet namespace is served in the hub's
    // domain (its streams set up by the site itself; no hub broker here).
    let site = site_with(&user_creds(dir.path(), "site1", &account), "site1");
    let mut bob = login(&site, "fleet", "bob");
    let mut alice = login(&site, "fleet", "alice");
    let r = send_until_ok(&mut bob, "alice", json!("over JWT creds"), "j1");
    assert_eq!(
        r["op"],
        "ok",
        "{r}\nsite log:\n{}\nhub log:\n{}",
        site.log(),
        hub.log()
    );
    let got = receive(&mut alice, 1);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["body"], "over JWT creds");
}

fn site_broker_named(relay: &Relay, site: &str) -> Broker {
    Broker::start_embedded(
        &site_config(),
        &[
            "--broker-id",
            site,
            "--leaf-remote",
            &format!("nats-leaf://site:leaf-secret@{}", relay.addr()),
            "--js-domain",
            site,
        ],
    )
}

/// Two sites each with a local namespace `local` (as the example has every site): its
/// subjects carry no site, and a leaf link carries every subject both ways, so a send at
/// one site reached the other's participant of the same name through the hub.
#[test]
fn sites_with_local_namespaces_of_one_name_do_not_hear_each_other() {
    let (hub, leaf_port) = hub();
    let _hub_broker = Broker::start(&hub.url(), &hub_config());
    let relay1 = Relay::start(&format!("127.0.0.1:{leaf_port}"));
    let relay2 = Relay::start(&format!("127.0.0.1:{leaf_port}"));
    let site1 = site_broker_named(&relay1, "site1");
    let site2 = site_broker_named(&relay2, "site2");
    let mut dave2 = login(&site2, "local", "dave");
    let mut carol2 = login(&site2, "local", "carol");
    let mut carol1 = login(&site1, "local", "carol");
    let mut dave1 = login(&site1, "local", "dave");
    // Both sites reach the hub (fleet sends are stored there).
    let mut alice1 = login(&site1, "fleet", "alice");
    let mut alice2 = login(&site2, "fleet", "alice");
    for (a, idem) in [(&mut alice1, "up1"), (&mut alice2, "up2")] {
        let r = send_until_ok(a, "bob", json!({"up": idem}), idem);
        assert_eq!(r["op"], "ok", "{r}");
    }
    let r = send_until_ok(&mut carol1, "dave", json!({"at": "site1"}), "l1");
    assert_eq!(r["op"], "ok", "{r}");
    let got = receive(&mut dave1, 1);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["body"]["at"], "site1");
    let leaked = dave2.next_op("message", Duration::from_secs(3));
    assert!(
        leaked.is_none(),
        "site2's dave got site1's message: {leaked:?}"
    );
    // Nor is site2's own traffic disturbed.
    let r = send_until_ok(&mut carol2, "dave", json!({"at": "site2"}), "l2");
    assert_eq!(r["op"], "ok", "{r}");
    let got = receive(&mut dave2, 1);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["body"]["at"], "site2");
    assert!(dave1.next_op("message", Duration::from_secs(1)).is_none());
}
