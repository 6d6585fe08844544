//! The OCR stages as task jobs, with the real PP-OCR models (ONNX Runtime through
//! snooze-backend-ort), driven by a stand-in for the core's scheduler: one queue per
//! model; the head job and every later one with its batch key while their rows fit
//! `max_batch_size`; one slice; a job that continues goes to the back of the queue.
//!
//! Read alone, a page's jobs give exactly [`read_page`]'s page (texts, scores, boxes)
//! and rapidocr's texts; read together, pages share runs and give the same pages.
#![allow(clippy::unwrap_used)]

mod common;

use common::{models, reference, root};
use std::{
    any::Any,
    collections::VecDeque,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, OnceLock,
    },
    time::{Duration, Instant},
};

use snooze_core::{InferError, LoadedModel, ModelSignature, Progress, TaskJob, Tensor, TensorData};
use snooze_vision::{
    jobs::{page_times, ClsJob, DetJob, JobTimes, RecJob},
    read_page, BgrImage, Document, InputLimits, OcrOptions, Page, Stage, StageTimes,
};

/// A model that counts its runs and their batch sizes, and fails while told to (as
/// an out-of-memory run would).
struct Counted {
    inner: Arc<dyn LoadedModel>,
    batches: Mutex<Vec<i64>>,
    failing: AtomicBool,
}

impl Counted {
    fn new(inner: &Arc<dyn LoadedModel>) -> Counted {
        Counted { inner: inner.clone(), batches: Mutex::new(Vec::new()), failing: AtomicBool::new(false) }
    }

    fn runs(&self) -> usize {
        self.batches.lock().unwrap().len()
    }

    fn batches(&self) -> Vec<i64> {
        self.batches.lock().unwrap().clone()
    }
}

impl LoadedModel for Counted {
    fn signature(&self) -> &ModelSignature {
        self.inner.signature()
    }

    fn infer(&self, inputs: &[Tensor], outputs: &[String]) -> Result<Vec<Tensor>, InferError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(InferError::OutOfMemory("the test's model is out of memory".into()));
        }
        self.batches.lock().unwrap().push(inputs[0].shape[0]);
        self.inner.infer(inputs, outputs)
    }
}

struct Stages {
    det: Counted,
    cls: Counted,
    rec: Counted,
}

impl Stages {
    fn new() -> Stages {
        let m = models();
        Stages { det: Counted::new(&m.det), cls: Counted::new(&m.cls), rec: Counted::new(&m.rec) }
    }

    fn runs(&self) -> [usize; 3] {
        [self.det.runs(), self.cls.runs(), self.rec.runs()]
    }
}

/// The scheduler's part for one model's queue; returns the jobs, done, in their order,
/// and the slices run.
fn drive(
    model: &dyn LoadedModel,
    jobs: Vec<Box<dyn TaskJob>>,
    max_rows: u32,
) -> (Vec<Box<dyn TaskJob>>, usize) {
    let mut slots: Vec<Option<Box<dyn TaskJob>>> = jobs.into_iter().map(Some).collect();
    let mut queue: VecDeque<usize> = (0..slots.len()).collect();
    let mut slices = 0;
    while let Some(head) = queue.pop_front() {
        let key = slots[head].as_ref().unwrap().batch_key();
        let mut rows = slots[head].as_ref().unwrap().rows();
        let mut batch = vec![head];
        queue.retain(|&i| {
            let job = slots[i].as_ref().unwrap();
            let fits = rows < max_rows && job.batch_key() == key && rows + job.rows() <= max_rows;
            if fits {
                rows += job.rows();
                batch.push(i);
            }
            !fits
        });
        let mut taken: Vec<Box<dyn TaskJob>> = batch.iter().map(|&i| slots[i].take().unwrap()).collect();
        let runner = taken[0].runner();
        let results = {
            let mut refs: Vec<&mut dyn TaskJob> = taken.iter_mut().map(|j| j.as_mut()).collect();
            runner(model, &mut refs)
        };
        slices += 1;
        assert!(slices < 10_000, "the jobs do not finish");
        assert_eq!(results.len(), batch.len());
        for ((i, job), result) in batch.into_iter().zip(taken).zip(results) {
            slots[i] = Some(job);
            match result.unwrap() {
                Progress::Continue => queue.push_back(i),
                Progress::Done => {}
            }
        }
    }
    (slots.into_iter().map(Option::unwrap).collect(), slices)
}

fn downcast<T: TaskJob>(job: Box<dyn TaskJob>) -> Box<T> {
    let any: Box<dyn Any> = job;
    any.downcast::<T>().unwrap()
}

fn boxed<T: TaskJob>(jobs: Vec<T>) -> Vec<Box<dyn TaskJob>> {
    jobs.into_iter().map(|j| Box::new(j) as Box<dyn TaskJob>).collect()
}

/// Pages read together, stage after stage, as the server's jobs would be.
fn read_together(images: &[&BgrImage], stages: &Stages, max_rows: u32) -> Vec<(Page, StageTimes)> {
    read_counting_runs(images, stages, max_rows).0
}

/// [`read_together`], and the runs per stage the pages' jobs say they took part in, each
/// counted once (what a request's `usage.runs` reports).
fn read_counting_runs(
    images: &[&BgrImage],
    stages: &Stages,
    max_rows: u32,
) -> (Vec<(Page, StageTimes)>, [usize; 3]) {
    let mut ids: [std::collections::BTreeSet<u64>; 3] = Default::default();
    let options = OcrOptions::default();
    let det = images.iter().map(|image| DetJob::new(image, &options).unwrap()).collect();
    let (det, _) = drive(&stages.det, boxed(det), max_rows);
    let mut found = Vec::new();
    let mut cls = Vec::new();
    for job in det {
        let job = downcast::<DetJob>(job);
        let det_times = job.times().clone();
        ids[0].extend(&det_times.run_ids);
        let mut page = job.into_result().unwrap();
        cls.push(ClsJob::new(std::mem::take(&mut page.crops), &options));
        found.push((page, det_times));
    }
    let (cls, _) = drive(&stages.cls, boxed(cls), max_rows);
    let mut cls_times: Vec<JobTimes> = Vec::new();
    let mut rec = Vec::new();
    for job in cls {
        let job = downcast::<ClsJob>(job);
        cls_times.push(job.times().clone());
        ids[1].extend(&job.times().run_ids);
        rec.push(RecJob::new(job.into_crops(), &options, models().decoder.clone()));
    }
    let (rec, _) = drive(&stages.rec, boxed(rec), max_rows);
    let pages = rec
        .into_iter()
        .zip(found)
        .zip(cls_times)
        .map(|((job, (page, det_times)), cls_times)| {
            let job = downcast::<RecJob>(job);
            let times = page_times(&det_times, &cls_times, job.times());
            ids[2].extend(&job.times().run_ids);
            (page.assemble(job.texts(), options.text_score), times)
        })
        .collect();
    (pages, ids.map(|s| s.len()))
}

fn fixture_pages() -> Vec<(String, BgrImage)> {
    let limits = InputLimits::default();
    reference()["pages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let file = p["file"].as_str().unwrap().to_owned();
            let bytes = std::fs::read(root().join("tests/fixtures").join(&file)).unwrap();
            let image = Document::open(bytes, &limits).unwrap().render_page(0, &limits).unwrap().image;
            (file, image)
        })
        .collect()
}

fn read_whole(image: &BgrImage) -> (Page, StageTimes) {
    let m = models();
    type Error = Box<dyn std::error::Error + Send + Sync>;
    let mut run = |stage: Stage, input: Tensor| -> Result<Tensor, Error> {
        let model = match stage {
            Stage::Detector => &m.det,
            Stage::Classifier => &m.cls,
            Stage::Recognizer => &m.rec,
        };
        Ok(model.infer(&[input], &[])?.remove(0))
    };
    read_page(image, &OcrOptions::default(), &m.decoder, &mut run).unwrap()
}

/// Each fixture page read alone through its jobs, with the model runs it took.
fn alone() -> &'static Vec<(String, Page, [usize; 3])> {
    static ALONE: OnceLock<Vec<(String, Page, [usize; 3])>> = OnceLock::new();
    ALONE.get_or_init(|| {
        fixture_pages()
            .into_iter()
            .map(|(file, image)| {
                let stages = Stages::new();
                let (page, _) = read_together(&[&image], &stages, 32).remove(0);
                (file, page, stages.runs())
            })
            .collect()
    })
}

#[test]
fn a_page_read_alone_through_its_jobs_is_read_page_and_rapidocr() {
    let pages = fixture_pages();
    for ((file, image), (_, page, runs)) in pages.iter().zip(alone()) {
        let (whole, times) = read_whole(image);
        assert_eq!(page, &whole, "{file}: the jobs and read_page disagree");
        assert_eq!(runs, &times.runs, "{file}: the jobs ran the models another number of times");
        let page_ref = reference()["pages"].as_array().unwrap().iter().find(|p| p["file"] == **file).unwrap();
        let expected: Vec<&str> =
            page_ref["lines"].as_array().unwrap().iter().map(|l| l["text"].as_str().unwrap()).collect();
        let texts: Vec<&str> = page.lines.iter().map(|l| l.text.as_str()).collect();
        assert_eq!(texts, expected, "{file}: rapidocr read other lines");
    }
}

#[test]
fn pages_queued_together_share_runs_and_read_the_same() {
    let pages = fixture_pages();
    let stages = Stages::new();
    let images: Vec<&BgrImage> = pages.iter().map(|(_, image)| image).collect();
    let (together, counted) = read_counting_runs(&images, &stages, 32);
    for ((page, _), (file, alone, _)) in together.iter().zip(alone()) {
        assert_eq!(page, alone, "{file}: read together, the page changed");
    }
    let mut alone_runs = [0; 3];
    for (_, _, runs) in alone() {
        for s in 0..3 {
            alone_runs[s] += runs[s];
        }
    }
    let runs = stages.runs();
    assert_eq!(counted, runs, "a run the pages shared is counted once");
    println!(
        "{} pages: runs alone (det, cls, rec) {alone_runs:?}, together {runs:?}; detector batches {:?}, \
         classifier {:?}, recogniser {:?}",
        pages.len(),
        stages.det.batches(),
        stages.cls.batches(),
        stages.rec.batches()
    );
    // fonts.png and fonts_jpeg.jpg are both 1000 x 720: one detector run for the two.
    assert_eq!(runs[0], alone_runs[0] - 1);
    assert!(stages.det.batches().contains(&2));
    assert!(runs[1] < alone_runs[1] && runs[2] < alone_runs[2], "{runs:?} vs {alone_runs:?}");

    // Two pages of different sizes: their classifier batches merge, no two detector inputs do.
    let two = Stages::new();
    let pair = [images[0], images[2]];
    let read = read_together(&pair, &two, 32);
    assert_eq!((&read[0].0, &read[1].0), (&alone()[0].1, &alone()[2].1));
    let (a, b) = (alone()[0].2, alone()[2].2);
    assert_eq!(two.det.runs(), 2);
    assert!(two.cls.runs() < a[1] + b[1], "{:?}", two.cls.batches());
    assert!(two.rec.runs() <= a[2] + b[2]);
}

#[test]
fn large_pages_never_share_a_detector_run() {
    // Shared, four A4 pages at 150 DPI held 1.7 GiB of activations at once.
    let options = OcrOptions::default();
    let key = |w, h| DetJob::new(&BgrImage::filled(w, h, [255; 3]), &options).unwrap().batch_key();
    assert_eq!(key(800, 600), key(800, 600), "small pages of one size share runs");
    assert_ne!(key(1240, 1754), key(1240, 1754), "an A4 page at 150 DPI runs alone");
    let job = DetJob::new(&BgrImage::filled(1240, 1754, [255; 3]), &options).unwrap();
    let (w, h) = job.input_size().unwrap();
    assert!(w * h >= snooze_vision::jobs::SOLO_PIXELS);
}

#[test]
fn a_blank_page_has_no_crops_and_its_later_jobs_run_no_model() {
    let stages = Stages::new();
    let white = BgrImage::filled(800, 600, [255; 3]);
    let (page, times) = read_together(&[&white], &stages, 32).remove(0);
    assert!(page.lines.is_empty() && page.text.is_empty());
    assert_eq!(stages.runs(), [1, 0, 0]);
    assert_eq!(times.runs, [1, 0, 0]);

    let options = OcrOptions::default();
    let mut cls = ClsJob::new(Vec::new(), &options);
    let mut rec = RecJob::new(Vec::new(), &options, models().decoder.clone());
    assert!(cls.is_done() && rec.is_done() && cls.rows() >= 1);
    let results = (cls.runner())(&stages.cls, &mut [&mut cls]);
    assert!(matches!(results[..], [Ok(Progress::Done)]));
    let results = (rec.runner())(&stages.rec, &mut [&mut rec]);
    assert!(matches!(results[..], [Ok(Progress::Done)]));
    assert_eq!(stages.runs(), [1, 0, 0]);
}

#[test]
fn a_failed_run_leaves_the_jobs_as_they_were() {
    let (_, image) = fixture_pages().remove(0);
    let stages = Stages::new();
    let options = OcrOptions::default();

    let mut det = DetJob::new(&image, &options).unwrap();
    let (key, size) = (det.batch_key(), det.byte_size());
    stages.det.failing.store(true, Ordering::SeqCst);
    let results = (det.runner())(&stages.det, &mut [&mut det]);
    assert!(matches!(results[..], [Err(InferError::OutOfMemory(_))]), "{results:?}");
    assert_eq!((det.is_done(), det.batch_key(), det.byte_size()), (false, key, size));
    stages.det.failing.store(false, Ordering::SeqCst);
    let results = (det.runner())(&stages.det, &mut [&mut det]);
    assert!(matches!(results[..], [Ok(Progress::Done)]));
    let found = det.into_result().unwrap();
    assert!(found.crops.len() > 6, "two classifier batches at least");

    let mut cls = ClsJob::new(found.crops.clone(), &options);
    let rows = cls.rows();
    stages.cls.failing.store(true, Ordering::SeqCst);
    let results = (cls.runner())(&stages.cls, &mut [&mut cls]);
    assert!(matches!(results[..], [Err(InferError::OutOfMemory(_))]));
    assert_eq!((cls.rows(), cls.orientations().iter().flatten().count()), (rows, 0));
    assert_eq!(cls.crops(), &found.crops[..]);
    stages.cls.failing.store(false, Ordering::SeqCst);
    let results = (cls.runner())(&stages.cls, &mut [&mut cls]);
    assert!(matches!(results[..], [Ok(Progress::Continue)]));
    assert_eq!(cls.orientations().iter().flatten().count(), rows as usize);

    let mut rec = RecJob::new(found.crops.clone(), &options, models().decoder.clone());
    let (key, size) = (rec.batch_key(), rec.byte_size());
    stages.rec.failing.store(true, Ordering::SeqCst);
    let results = (rec.runner())(&stages.rec, &mut [&mut rec]);
    assert!(matches!(results[..], [Err(InferError::OutOfMemory(_))]));
    assert_eq!((rec.batch_key(), rec.byte_size()), (key, size));
    assert!(rec.texts().iter().all(|(t, _)| t.is_empty()));
    stages.rec.failing.store(false, Ordering::SeqCst);
    let results = (rec.runner())(&stages.rec, &mut [&mut rec]);
    assert!(matches!(results[..], [Ok(Progress::Continue)]));
    assert!(rec.byte_size() < size, "the crops read are freed");
    assert_eq!(rec.texts().iter().filter(|(t, _)| !t.is_empty()).count(), 6);
}

#[test]
fn a_job_on_the_wrong_model_fails_with_a_sentence() {
    let (_, image) = fixture_pages().into_iter().find(|(f, _)| f.contains("small")).unwrap();
    let options = OcrOptions::default();
    let m = models();
    let mut det = DetJob::new(&image, &options).unwrap();
    let results = (det.runner())(m.det.as_ref(), &mut [&mut det]);
    assert!(matches!(results[..], [Ok(Progress::Done)]));
    let crops = det.into_result().unwrap().crops;

    // The recogniser's crops on the classifier: its [n, 2] output is no [n, T, C].
    let mut rec = RecJob::new(crops.clone(), &options, m.decoder.clone());
    let results = (rec.runner())(m.cls.as_ref(), &mut [&mut rec]);
    let Err(InferError::Failed(message)) = &results[0] else { panic!("{results:?}") };
    assert!(message.contains("recogniser model gave an output"), "{message}");
    assert!(!rec.is_done());

    // A classifier job handed to the recogniser's runner.
    let mut cls = ClsJob::new(crops, &options);
    let results = (rec.runner())(m.rec.as_ref(), &mut [&mut cls, &mut rec]);
    let Err(InferError::Failed(message)) = &results[0] else { panic!("{results:?}") };
    assert!(message.contains("another stage"), "{message}");
    assert!(results[1].is_ok(), "{:?}", results[1]);
}

/// Milliseconds per stage (model, and this crate's work) for 4 pages read one by one
/// and queued together: the detector's on 4 pages of one size, the classifier's and
/// recogniser's on 4 different pages; then each model's time per page or crop by batch
/// size (the fastest of 3 runs).
/// `cargo test -p snooze-vision --test jobs -- --ignored --nocapture`
#[test]
#[ignore = "a measurement: run it alone"]
fn measure_four_pages_alone_and_batched() {
    let pages = fixture_pages();
    let pick = |name: &str| &pages.iter().find(|(f, _)| f.ends_with(name)).unwrap().1;
    let same_size = [pick("fonts.png"), pick("fonts_jpeg.jpg"), pick("fonts.png"), pick("fonts_jpeg.jpg")];
    let mixed = [pick("fonts.png"), pick("columns.png"), pick("upside_down.png"), pick("color.png")];
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let _ = read_together(&[mixed[0]], &Stages::new(), 32); // warm the sessions
    for (what, set) in [("4 pages of one size", same_size), ("4 pages of different sizes", mixed)] {
        println!("{what}:");
        for together in [false, true] {
            let stages = Stages::new();
            let started = Instant::now();
            let read: Vec<(Page, StageTimes)> = if together {
                read_together(&set, &stages, 32)
            } else {
                set.iter().flat_map(|image| read_together(&[image], &stages, 32)).collect()
            };
            let wall = started.elapsed();
            let sum = |f: fn(&StageTimes) -> Duration| ms(read.iter().map(|(_, t)| f(t)).sum());
            println!(
                "  {}: wall {:.0} ms; det model {:.0} in {} runs (pre {:.0}, post {:.0}); cls model {:.1} in {} \
                 runs (pre/post {:.1}); rec model {:.0} in {} runs (pre/post {:.0}); batches det {:?} cls {:?} \
                 rec {:?}",
                if together { "together" } else { "one by one" },
                ms(wall),
                sum(|t| t.det_model),
                stages.det.runs(),
                sum(|t| t.det_pre),
                sum(|t| t.det_post),
                sum(|t| t.cls_model),
                stages.cls.runs(),
                sum(|t| t.cls_pre_post),
                sum(|t| t.rec_model),
                stages.rec.runs(),
                sum(|t| t.rec_pre_post),
                stages.det.batches(),
                stages.cls.batches(),
                stages.rec.batches(),
            );
        }
    }

    // Why a recogniser batch shares a run only with batches of its own width: the k-th
    // batch of every page in one run, padded to the widest, against each page's own.
    let m = models();
    let options = OcrOptions::default();
    let crops: Vec<Vec<BgrImage>> = pages
        .iter()
        .map(|(_, image)| {
            let mut det = DetJob::new(image, &options).unwrap();
            (det.runner())(m.det.as_ref(), &mut [&mut det]);
            let mut cls = ClsJob::new(det.into_result().unwrap().crops, &options);
            while !cls.is_done() {
                (cls.runner())(m.cls.as_ref(), &mut [&mut cls]);
            }
            cls.into_crops()
        })
        .collect();
    let plans: Vec<Vec<Vec<usize>>> =
        crops.iter().map(|c| snooze_vision::plan_batches(c, options.rec_batch_num)).collect();
    let read = |batch: &[&BgrImage]| {
        let output = m.rec.infer(&[snooze_vision::rec_input(batch)], &[]).unwrap().remove(0);
        m.decoder.decode(&output, batch.len()).unwrap()
    };
    let (mut compared, mut texts_changed, mut scores_changed, mut worst) = (0, 0, 0, 0f32);
    for k in 0..plans.iter().map(Vec::len).max().unwrap() {
        let members: Vec<(usize, usize)> = plans
            .iter()
            .enumerate()
            .filter(|(_, p)| k < p.len())
            .flat_map(|(n, p)| p[k].iter().map(move |&i| (n, i)))
            .collect();
        let merged = read(&members.iter().map(|&(n, i)| &crops[n][i]).collect::<Vec<_>>());
        let mut own = Vec::new();
        for (n, plan) in plans.iter().enumerate().filter(|(_, p)| k < p.len()) {
            own.extend(read(&plan[k].iter().map(|&i| &crops[n][i]).collect::<Vec<_>>()));
        }
        for ((text, score), (own_text, own_score)) in merged.iter().zip(&own) {
            compared += 1;
            texts_changed += usize::from(text != own_text);
            scores_changed += usize::from(text == own_text && score != own_score);
            worst = worst.max((score - own_score).abs());
        }
    }
    println!(
        "recogniser batches of all pages padded to the widest: {texts_changed} of {compared} texts and \
         {scores_changed} scores changed (by up to {worst:.5})"
    );

    // Model time per row by batch size, the rows all alike.
    let fastest = |model: &Arc<dyn LoadedModel>, input: &Tensor, rows: usize, tries: usize| {
        let TensorData::Fp32(one) = &input.data else { unreachable!() };
        let mut shape = input.shape.clone();
        shape[0] = rows as i64;
        let batch = Tensor::new("x", shape, TensorData::Fp32(one.repeat(rows)));
        let best = (0..tries)
            .map(|_| {
                let started = Instant::now();
                model.infer(std::slice::from_ref(&batch), &[]).unwrap();
                started.elapsed()
            })
            .min()
            .unwrap();
        ms(best) / rows as f64
    };
    let page = snooze_vision::prepare_page(pick("fonts.png"), &options);
    let det = snooze_vision::det_input(&page.image, &options).unwrap();
    let per_page: Vec<String> =
        [1, 2, 4].iter().map(|&b| format!("{b}: {:.0}", fastest(&m.det, &det, b, 2))).collect();
    println!("detector ms per page ({:?} input) by batch: {}", &det.shape[1..], per_page.join(", "));
    let crop =
        snooze_vision::crop_box(&page.image, &[[40.0, 28.0], [200.0, 28.0], [200.0, 50.0], [40.0, 50.0]]);
    for (name, model, input) in [
        ("classifier", &m.cls, snooze_vision::cls_input(&[&crop])),
        ("recogniser", &m.rec, snooze_vision::rec_input(&[&crop])),
    ] {
        let per_crop: Vec<String> =
            [1, 6, 12, 24].iter().map(|&b| format!("{b}: {:.2}", fastest(model, &input, b, 3))).collect();
        println!("{name} ms per crop ({:?} input) by batch: {}", &input.shape[1..], per_crop.join(", "));
    }
}
