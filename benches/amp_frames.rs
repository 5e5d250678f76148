//! Client-frame decoding (classify, validate against the op's schema, type) against a
//! baseline measured in the same run: parsing the same text into a `serde_json::Value`.
//! Compare the ratio, not the absolute times.

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;

use amp_broker::amp::FrameValidator;

const SEND: &str = r#"{"op":"send","id":"s1","to":"worker-2","body":{"order":42,"items":["a","b","c"],"note":"hello"},"headers":{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},"idem":"k-1"}"#;
const SUBMIT: &str = r#"{"op":"submit","id":"t1","job":"render","body":{"scene":7},"task":"T-1","max_attempts":3,"eligible":{"names":["w1","w2"],"labels":{"gpu":"a100"}}}"#;
const BAD: &str = r#"{"op":"send","id":"s1","to":"worker-2","body":1,"from":"acme/x"}"#;

fn frames(c: &mut Criterion) {
    let started = std::time::Instant::now();
    let v = FrameValidator::new().expect("schema compiles");
    eprintln!("FrameValidator::new: {:?}", started.elapsed());
    let mut g = c.benchmark_group("amp_frames");
    g.bench_function("baseline_serde_value_send", |b| {
        b.iter(|| serde_json::from_str::<serde_json::Value>(black_box(SEND)))
    });
    g.bench_function("decode_send", |b| b.iter(|| v.decode(black_box(SEND))));
    g.bench_function("decode_submit", |b| b.iter(|| v.decode(black_box(SUBMIT))));
    g.bench_function("reject_unknown_member", |b| {
        b.iter(|| v.decode(black_box(BAD)))
    });
    g.finish();
}

criterion_group!(benches, frames);
criterion_main!(benches);
