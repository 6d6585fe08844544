//! One page through detector, classifier and recogniser, with the models behind a
//! closure: the stages in rapidocr's order, for callers that run a page in one go
//! (tests, a CLI, a server path without slicing) and as the reference for the
//! server's sliced job, which calls the same functions between its model runs.
//!
//! The closure gets the stage and its input tensor and returns the model's first
//! output. The time spent in this crate's functions and in the closure is kept per
//! stage, to tell pre/post-processing cost from model cost.

use std::time::{Duration, Instant};

use snooze_core::Tensor;

use crate::{
    batch::plan_batches,
    bgr::BgrImage,
    cls::{apply_orientation, cls_decode, cls_input},
    crop::crop_box,
    db::text_boxes,
    det::{det_input, prepare_page},
    error::VisionError,
    options::OcrOptions,
    page::{assemble_page, Page},
    rec::{rec_input, CtcDecoder},
};

/// Which model a tensor is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    Detector,
    Classifier,
    Recognizer,
}

/// Time spent on one page: in this crate's functions and in the models, per stage.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageTimes {
    /// Bounds, padding and the detector's input.
    pub det_pre: Duration,
    pub det_model: Duration,
    /// Contours, boxes and the perspective crops.
    pub det_post: Duration,
    pub cls_pre_post: Duration,
    pub cls_model: Duration,
    pub rec_pre_post: Duration,
    pub rec_model: Duration,
    /// Model runs, per stage.
    pub runs: [usize; 3],
}

impl StageTimes {
    pub fn processing(&self) -> Duration {
        self.det_pre + self.det_post + self.cls_pre_post + self.rec_pre_post
    }

    pub fn models(&self) -> Duration {
        self.det_model + self.cls_model + self.rec_model
    }
}

/// Reads one page. `run(stage, input)` runs the stage's model; its errors are passed
/// through, and this crate's (a model output it cannot read) converted into `E`.
pub fn read_page<E: From<VisionError>>(
    image: &BgrImage,
    options: &OcrOptions,
    decoder: &CtcDecoder,
    run: &mut dyn FnMut(Stage, Tensor) -> Result<Tensor, E>,
) -> Result<(Page, StageTimes), E> {
    options.validate()?;
    let mut times = StageTimes::default();
    let mut clock = Instant::now();
    let lap = |clock: &mut Instant| {
        let now = Instant::now();
        let spent = now - *clock;
        *clock = now;
        spent
    };

    let prepared = prepare_page(image, options);
    let (page_w, page_h) = (prepared.image.width(), prepared.image.height());
    let Some(input) = det_input(&prepared.image, options) else {
        return Ok((assemble_page(&prepared.geometry, &[], &[], options.text_score), times));
    };
    times.det_pre = lap(&mut clock);
    let output = run(Stage::Detector, input)?;
    times.det_model = lap(&mut clock);
    times.runs[0] += 1;
    let boxes = text_boxes(&output, page_w, page_h, options)?;
    let mut crops: Vec<BgrImage> = boxes.iter().map(|b| crop_box(&prepared.image, &b.quad)).collect();
    times.det_post = lap(&mut clock);

    if options.use_cls {
        for batch in plan_batches(&crops, options.cls_batch_num) {
            let input = cls_input(&batch.iter().map(|&i| &crops[i]).collect::<Vec<_>>());
            times.cls_pre_post += lap(&mut clock);
            let output = run(Stage::Classifier, input)?;
            times.cls_model += lap(&mut clock);
            times.runs[1] += 1;
            for (&i, orientation) in batch.iter().zip(cls_decode(&output, batch.len())?) {
                let crop = std::mem::replace(&mut crops[i], BgrImage::filled(0, 0, [0; 3]));
                crops[i] = apply_orientation(crop, orientation, options.cls_thresh);
            }
            times.cls_pre_post += lap(&mut clock);
        }
    }

    let mut texts = vec![(String::new(), 0.0f32); crops.len()];
    for batch in plan_batches(&crops, options.rec_batch_num) {
        let input = rec_input(&batch.iter().map(|&i| &crops[i]).collect::<Vec<_>>());
        times.rec_pre_post += lap(&mut clock);
        let output = run(Stage::Recognizer, input)?;
        times.rec_model += lap(&mut clock);
        times.runs[2] += 1;
        for (&i, text) in batch.iter().zip(decoder.decode(&output, batch.len())?) {
            texts[i] = text;
        }
        times.rec_pre_post += lap(&mut clock);
    }
    let page = assemble_page(&prepared.geometry, &boxes, &texts, options.text_score);
    times.rec_pre_post += lap(&mut clock);
    Ok((page, times))
}
