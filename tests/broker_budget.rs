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
