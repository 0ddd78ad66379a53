use std::sync::Arc;
fn main() {
    let path = std::env::args().nth(1).expect("path");
    let toks: Vec<u32> = std::env::args().nth(2).unwrap().split(',').map(|s| s.parse().unwrap()).collect();
    let src = ts_formats::open_model(std::path::Path::new(&path)).unwrap();
    let be = Arc::new(ts_cpu::CpuBackend::new(None).unwrap());
    let mut m = ts_models::load(src.as_ref(), be, ts_models::RuntimeOptions { ctx: 256, n_slots: 1, max_batch: 64 }).unwrap();
    let nv = m.info().n_vocab;
    let b = ts_core::BatchMeta::sequence(&toks, 0, 256, true);
    let mut lg = vec![0f32; toks.len() * nv];
    let t0 = std::time::Instant::now();
    m.forward(&b, &mut lg).unwrap();
    eprintln!("prefill {:?}", t0.elapsed());
    for (i, row) in lg.chunks(nv).enumerate() {
        let mut idx: Vec<usize> = (0..nv).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        println!("pos {i}: top {:?}", idx[..5].iter().map(|&j| (j, row[j])).collect::<Vec<_>>());
    }
    // greedy decode 20
    let mut pos = toks.len() as u32;
    let mut t = { let r = &lg[(toks.len()-1)*nv..]; (0..nv).max_by(|&a,&b| r[a].total_cmp(&r[b])).unwrap() as u32 };
    let mut out = vec![t];
    let mut l1 = vec![0f32; nv];
    let t0 = std::time::Instant::now();
    for _ in 0..30 {
        let b = ts_core::BatchMeta::sequence(&[t], pos, 256, false);
        m.forward(&b, &mut l1).unwrap();
        pos += 1;
        t = (0..nv).max_by(|&a,&b| l1[a].total_cmp(&l1[b])).unwrap() as u32;
        out.push(t);
    }
    eprintln!("decode 30 in {:?} = {:.1} tok/s", t0.elapsed(), 30.0 / t0.elapsed().as_secs_f64());
    println!("greedy: {:?}", out);
}
