//! Task budgets through the broker: counted in JetStream, so two brokers enforce one.

mod common;

use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use serde_json::json;

#[test]
fn two_brokers_enforce_one_task_budget_per_window() {
    let nats = NatsServer::start();
    let mut config = open_config(&["app"]);
    config["namespaces"]["acme"]["participants"]["app"]["policy"] =
        json!({"tasks_per_window": 3, "window_s": 3600});
    config["namespaces"]["acme"]["jobs"] = json!({"render": {}});
    let one = Broker::start(&nats.url(), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&one, "acme", "app", "app-token");
    let mut b = Client::login(&two, "acme", "app", "app-token");
    let submit = |c: &mut Client, i: u32| c.request(json!({"op":"submit","job":"render","body":i}));
    assert_eq!(submit(&mut a, 1)["op"], "ok");
    assert_eq!(submit(&mut b, 2)["op"], "ok");
    let third = [submit(&mut a, 3), submit(&mut b, 4)];
    let admitted = third.iter().filter(|r| r["op"] == "ok").count();
    let refused: Vec<_> = third
        .iter()
        .filter(|r| r["code"] == "budget_exhausted")
        .collect();
    assert_eq!(
        (admitted, refused.len()),
        (1, 1),
        "exactly the budget is admitted: {third:?}"
    );
    for c in [&mut a, &mut b] {
        let e = submit(c, 9);
        assert_eq!(e["code"], "budget_exhausted", "{e}");
    }
}

/// Spec 2.6: a request that fails changes nothing a later request can observe. A submit
/// the participant may not make, or whose task id is the broker's own, used to be charged
/// to its rate and budget before the checks refused it.
#[test]
fn a_refused_submit_spends_nothing_of_the_budget() {
    let nats = NatsServer::start();
    let mut config = open_config(&["app"]);
    let app = &mut config["namespaces"]["acme"]["participants"]["app"];
    app["policy"] = json!({"tasks_per_window": 2, "window_s": 3600});
    app["permissions"]["submit"] = json!(["render"]);
    config["namespaces"]["acme"]["jobs"] = json!({"render": {}, "other": {}});
    let broker = Broker::start(&nats.url(), &config);
    let mut c = Client::login(&broker, "acme", "app", "app-token");
    for i in 0..3 {
        let e = c.request(json!({"op":"submit","job":"other","body":i}));
        assert_eq!(e["code"], "forbidden", "{e}");
        let e = c.request(json!({"op":"submit","job":"render","task":"redrive-x","body":i}));
        assert_eq!(e["code"], "schema", "{e}");
    }
    for i in 0..2 {
        let r = c.request(json!({"op":"submit","job":"render","body":i}));
        assert_eq!(r["op"], "ok", "the budget is whole after refusals: {r}");
    }
    let e = c.request(json!({"op":"submit","job":"render","body":9}));
    assert_eq!(e["code"], "budget_exhausted", "{e}");
}

/// Spec 2.6 again, for what only the task store or the engine can refuse: a submit whose
/// task id another participant holds (`conflict`), one too large to store (`too_large`,
/// by its body alone or once its envelope is made), a redrive of a letter that is not
/// there (`not_found`). Each spent a task of the budget: two conflicts left nothing of a
/// budget of 2.
#[test]
fn a_submit_the_engine_refuses_spends_nothing_of_the_budget() {
    let nats = NatsServer::with_config("max_payload: 65536");
    let mut config = open_config(&["app", "a"]);
    config["namespaces"]["acme"]["participants"]["app"]["policy"] =
        json!({"tasks_per_window": 2, "window_s": 3600});
    config["namespaces"]["acme"]["jobs"] = json!({"render": {}});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut c = Client::login(&broker, "acme", "app", "app-token");
    let r = a.request(json!({"op":"submit","job":"render","task":"T","body":1}));
    assert_eq!(r["op"], "ok", "{r}");
    for i in 0..2 {
        let e = c.request(json!({"op":"submit","job":"render","task":"T","body":i}));
        assert_eq!(e["code"], "conflict", "{e}");
    }
    // Past max_payload by its body alone, and by its envelope only.
    for n in [70_000, 65_500] {
        let e = c.request(json!({"op":"submit","job":"render","body":"x".repeat(n)}));
        assert_eq!(e["code"], "too_large", "{n}: {e}");
    }
    let e = c.request(json!({"op":"redrive","job":"render","seq":999}));
    assert_eq!(e["code"], "not_found", "{e}");
    for i in 0..2 {
        let r = c.request(json!({"op":"submit","job":"render","body":i}));
        assert_eq!(r["op"], "ok", "the budget is whole after refusals: {r}");
    }
    let e = c.request(json!({"op":"submit","job":"render","body":9}));
    assert_eq!(e["code"], "budget_exhausted", "{e}");
}
